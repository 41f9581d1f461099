"""The generation routes' bodies and replies (docs/http-api.md "Generation"): /generate, /submit,
/submit_many, /poll, /result, /cancel, /abort_request."""

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from grctl.protocol.catalog import ItemResultOut

PosInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]


class SamplingParamsBody(Struct, kw_only=True):
    max_new_tokens: PosInt = 1
    n: PosInt = 1  # n > 1: beam search of width n
    temperature: Annotated[float, Meta(ge=0.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1  # -1: the whole vocabulary
    seed: int | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    use_catalog: bool = True  # false: not constrained to the served item catalog
    logits_processors: list[Any] | None = None  # also accepted at the top level


class GenerateBody(Struct, kw_only=True):
    # One prompt [S], or a batch [[S], ...] answered by a list of replies in order (SGLang).
    input_ids: list[TokenId | list[TokenId]] | None = None
    text: str | list[str] | None = None  # needs a tokenizer in the model directory
    # One for all prompts of a batch, or one per prompt.
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    return_logprob: bool = False
    rid: str | list[str] | None = None  # a batch takes a list, one id per prompt
    request_id: str | None = None  # alias of rid (one prompt)
    stream: bool = False  # streaming is not supported: true is a 400
    # [{"type": "token_suppress" | "token_bias", ...}] (grctl/engine/search/logits_processors.py)
    logits_processors: list[Any] | None = None


class SubmitManyBody(Struct, kw_only=True):
    requests: list[GenerateBody] = msgspec.field(default_factory=list)


class CancelBody(Struct, kw_only=True):
    request_id: str | None = None
    rid: str | None = None  # alias of request_id


class AbortRequestBody(Struct, kw_only=True):
    rid: str | None = None
    abort_all: bool = False


class FinishReason(Struct, kw_only=True, omit_defaults=True):
    type: str = ""  # "length" | "stop" | "item_complete" | "abort"; the server always sends one
    matched: int | None = None  # the stop token, when type == "stop"
    length: int | None = None  # the number of generated tokens, when type == "length"


class BeamMetaInfo(Struct, kw_only=True):
    sequence_score: float = 0.0  # cumulative log-probability of output_ids
    finish_reason: FinishReason | None = None


class BeamOut(Struct, kw_only=True):
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: BeamMetaInfo = msgspec.field(default_factory=BeamMetaInfo)


class MetaInfo(Struct, kw_only=True):
    id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason = msgspec.field(default_factory=FinishReason)
    weight_version: str = ""
    weight_versions: list[str] = msgspec.field(default_factory=list)
    beam_width: int = 1
    beam_results: list[BeamOut] = msgspec.field(default_factory=list)
    e2e_latency: float = 0.0
    # SGLang's shape: one [logprob, token_id, token_text] per output token; text is always null.
    output_token_logprobs: list[tuple[float, int, None]] | None = None
    # with an item catalog: one row per beam, in beam order, and the catalog's version
    item_results: list[ItemResultOut] | None = None
    catalog_version: int | None = None


class StrictMetaInfo(MetaInfo, kw_only=True, omit_defaults=True):
    """The meta_info the server sends: these keys always; the optional ones only when set."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    weight_version: str
    weight_versions: list[str]
    beam_width: int
    beam_results: list[BeamOut]
    e2e_latency: float


class GenerateResponse(Struct, kw_only=True):
    text: str = ""  # decoded with a tokenizer, else the ids joined by spaces
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: MetaInfo = msgspec.field(default_factory=MetaInfo)


class SubmitResponse(Struct, kw_only=True):
    request_id: str = ""


class SubmitManyResponse(Struct, kw_only=True):
    request_ids: list[str] = msgspec.field(default_factory=list)


class PollResponse(Struct, kw_only=True):
    ready: bool = False
    response: GenerateResponse | None = None


class CancelResponse(Struct, kw_only=True):
    request_id: str = ""
    cancelled: bool = False  # false: it had already finished


class AbortRequestResponse(Struct, kw_only=True):
    success: bool = True
    num_aborted_requests: int = 0
