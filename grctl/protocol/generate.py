"""msgspec Structs for every serving body (docs/http-api.md "Generation").

Request bodies ignore unknown keys (msgspec's default) and Litestar converts them with
strict=False, so "3" is read as 3 where an int is expected. A missing body is `None` in the
handler and means all defaults. No `from __future__ import annotations`: msgspec and Litestar
read these annotations at runtime.
"""

from typing import Annotated, Any

import msgspec
from litestar.openapi.datastructures import ResponseSpec
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


class FlushCacheBody(Struct, kw_only=True):
    timeout: Annotated[float, Meta(ge=0.0)] | None = None  # seconds to wait for an idle engine


class FinishReason(Struct, kw_only=True, omit_defaults=True):
    type: str  # "length" | "stop" | "item_complete" | "abort"
    matched: int | None = None  # the stop token, when type == "stop"
    length: int | None = None  # the number of generated tokens, when type == "length"


class BeamMetaInfo(Struct, kw_only=True):
    sequence_score: float  # cumulative log-probability of output_ids
    finish_reason: FinishReason


class BeamOut(Struct, kw_only=True):
    output_ids: list[int]
    meta_info: BeamMetaInfo


class MetaInfo(Struct, kw_only=True, omit_defaults=True):
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
    # SGLang's shape: one [logprob, token_id, token_text] per output token; text is always null.
    output_token_logprobs: list[tuple[float, int, None]] | None = None
    # with an item catalog: one row per beam, in beam order, and the catalog's version
    item_results: list[ItemResultOut] | None = None
    catalog_version: int | None = None


class GenerateResponse(Struct, kw_only=True):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class SubmitResponse(Struct, kw_only=True):
    request_id: str


class SubmitManyResponse(Struct, kw_only=True):
    request_ids: list[str]


class PollResponse(Struct, kw_only=True):
    ready: bool
    response: GenerateResponse | None = None


class CancelResponse(Struct, kw_only=True):
    request_id: str
    cancelled: bool  # false: it had already finished


class AbortRequestResponse(Struct, kw_only=True):
    success: bool
    num_aborted_requests: int


class HealthResponse(Struct, kw_only=True):
    ok: bool


class ReadyResponse(Struct, kw_only=True):
    ready: bool
    reasons: list[str]
    paused: bool
    weight_version: str
    num_in_flight: int


class FlushCacheResponse(Struct, kw_only=True, omit_defaults=True):
    success: bool
    entries_cleared: int | None = None
    message: str | None = None
    error: dict[str, Any] | None = None  # the error shape, when success is false


class LoadsResponse(Struct, kw_only=True):
    num_reqs: int
    num_waiting_reqs: int
    num_running_reqs: int


class ServerInfo(Struct, kw_only=True):
    model_path: str
    weight_version: str
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    num_gpus: int = 1
    enable_memory_saver: bool = False
    disaggregation_mode: str = "null"
    device: str = "cpu"
    gpu_uuid: str | None = None  # names the GPU under any CUDA_VISIBLE_DEVICES; null off CUDA
    dtype: str = "float32"
    served_model_name: str = ""
    context_length: int = 0
    max_running_requests: int = 0
    max_waiting_requests: int = 0
    max_beam_width: int = 0
    max_new_tokens: int = 0
    enable_prefill_cache: bool = False
    allow_weight_update: bool = False
    version: str = ""


class ModelInfo(Struct, kw_only=True):
    model_path: str
    weight_version: str
    served_model_name: str = ""
    is_generation: bool = True
    tokenizer_path: str | None = None
    vocab_size: int = 0
    model_config: dict[str, Any] | None = None  # the served structure, as an HF config.json


class ErrorDetail(Struct, kw_only=True):
    code: str
    message: str
    retryable: bool
    status: int


class ErrorResponse(Struct, kw_only=True):
    error: ErrorDetail


ERROR_DESCRIPTIONS = {
    400: "validation_error",
    404: "not_found",
    409: "duplicate_request_id",
    413: "payload_too_large",
    429: "overloaded (retryable)",
    503: "paused, weights_inconsistent or memory_released (retryable)",
    504: "generate_timeout (retryable)",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI entries for the errors a route can answer, all in the one error shape."""
    return {
        s: ResponseSpec(data_container=ErrorResponse, description=ERROR_DESCRIPTIONS[s])
        for s in statuses
    }
