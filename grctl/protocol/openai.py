"""The OpenAI-compatible routes' bodies and replies (docs/http-api.md "OpenAI-compatible routes"):
/v1/models, /v1/completions, /v1/chat/completions, and their stream chunks.

The fields are OpenAI's, with SGLang's extras (top_k, stop_token_ids, ignore_eos, rid) and
grctl's (use_catalog, logits_processors). `n > 1` is beam search of width n, as on /generate:
each beam is one choice, best first. Every choice carries `meta_info` (its token ids, score,
finish reason, weight versions, catalog items) and every reply `metadata` (SGLang's
weight_version), extension fields an OpenAI client keeps as extra attributes.
"""

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from grctl.protocol.generate import FinishReason, WeightVersionSpan
from grctl.protocol.stages import ForcedPrefix, ReasoningParams, ReturnMode, StageSpan

PosInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class OpenAIBody(Struct, kw_only=True):
    """What both routes take."""

    model: str = "default"  # echoed back; grctl serves one model whatever it is called
    n: PosInt = 1  # > 1: beam search of width n, one choice per beam
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0  # 0: greedy (n == 1)
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    seed: int | None = None
    stop: str | list[str] | None = None  # stop strings: refused (send stop_token_ids)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0  # only the default is served
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # refused: send logits_processors
    use_catalog: bool = True
    logits_processors: list[Any] | None = None  # as on /generate
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: str | None = None
    user: str | None = None
    # a multi-stage request (docs/http-api.md "Multi-stage requests"), in grctl's spelling as
    # extra body fields (as SGLang and vLLM take their extra sampling params): the reasoning
    # stage, then the forced prefix; n, max_tokens, temperature, top_p, top_k, seed and
    # use_catalog are the item stage's, and every returned beam of every sample is a choice
    reasoning: ReasoningParams | None = None
    forced_prefix: ForcedPrefix | None = None
    beam_return_mode: ReturnMode | None = None


class CompletionBody(OpenAIBody, kw_only=True):
    # text, a batch of texts, token ids, or a batch of token id lists
    prompt: str | list[Any] | None = None
    max_tokens: Annotated[int, Meta(ge=0)] = 16  # 0: nothing generated (echo: score the prompt)
    logprobs: Annotated[int, Meta(ge=0)] | None = None  # the chosen token's only
    echo: bool = False  # the prompt before the completion; with logprobs, its tokens' too
    suffix: str | None = None  # refused


class ChatMessageIn(Struct, kw_only=True):
    role: str = "user"
    content: str | list[dict[str, Any]] | None = None  # a string, or [{"type": "text", ...}]
    name: str | None = None


class ChatCompletionBody(OpenAIBody, kw_only=True):
    messages: list[ChatMessageIn] = msgspec.field(default_factory=list)
    max_tokens: PosInt | None = None  # default: the server's --max-new-tokens
    max_completion_tokens: PosInt | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0)] | None = None  # only 0: no alternatives
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # refused
    response_format: dict[str, Any] | None = None  # only {"type": "text"}


# ---- replies ---------------------------------------------------------------------------------


class Usage(Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChoiceMeta(Struct, kw_only=True, omit_defaults=True):
    """grctl's extension on every choice: /generate's beam, as computed."""

    output_ids: list[int] = msgspec.field(default_factory=list)  # with the stop token
    sequence_score: float = 0.0
    finish_reason: FinishReason = msgspec.field(default_factory=FinishReason)
    weight_version: str = ""
    weight_versions: list[WeightVersionSpan] = msgspec.field(default_factory=list)  # output_ids'
    request_id: str = ""
    # with an item catalog
    item_ids: list[int | str] | None = None
    item_id: int | str | None = None
    is_complete: bool | None = None
    catalog_version: int | None = None
    # a multi-stage request's beam: its reasoning sample (a GRPO group), and which response
    # positions were sampled, forced or searched
    group_id: str | None = None
    group_index: int | None = None
    beam_index: int | None = None
    stage_spans: list[StageSpan] | None = None


class Metadata(Struct, kw_only=True):
    """SGLang's `metadata` on a reply: the versions of its first request."""

    weight_version: str = ""
    weight_versions: list[WeightVersionSpan] = msgspec.field(default_factory=list)


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str] = msgspec.field(default_factory=list)
    # with echo the prompt's tokens come first, the very first without a logprob (null)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(Struct, kw_only=True):
    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # stop | length | abort
    matched_stop: int | None = None
    meta_info: ChoiceMeta | None = None


class CompletionResponse(Struct, kw_only=True):
    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[CompletionChoice] = msgspec.field(default_factory=list)
    usage: Usage | None = None
    metadata: Metadata | None = None


class TokenLogprob(Struct, kw_only=True):
    token: str = ""
    bytes: list[int] | None = None
    logprob: float | None = 0.0  # null: a multi-stage request's forced prefix
    top_logprobs: list[Any] = msgspec.field(default_factory=list)


class ChatLogprobs(Struct, kw_only=True):
    content: list[TokenLogprob] = msgspec.field(default_factory=list)


class ChatMessageOut(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(Struct, kw_only=True):
    index: int = 0
    message: ChatMessageOut = msgspec.field(default_factory=ChatMessageOut)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | None = None
    meta_info: ChoiceMeta | None = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[ChatChoice] = msgspec.field(default_factory=list)
    usage: Usage | None = None
    metadata: Metadata | None = None


class ChatDelta(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: ChatDelta = msgspec.field(default_factory=ChatDelta)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | None = None
    meta_info: ChoiceMeta | None = None  # on the choice's last chunk


class ChatCompletionChunk(Struct, kw_only=True):
    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChatChunkChoice] = msgspec.field(default_factory=list)
    usage: Usage | None = None


class ModelCard(Struct, kw_only=True):
    id: str = ""
    object: str = "model"
    created: int = 0
    owned_by: str = "grctl"
    root: str = ""  # the model path
    parent: str | None = None
    max_model_len: int = 0


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard] = msgspec.field(default_factory=list)
