"""The generation routes' bodies and replies (docs/http-api.md "Generation"): /generate, /submit,
/submit_many, /poll, /result, /cancel, /abort_request."""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from grctl.protocol.catalog import ItemResultOut
from grctl.protocol.stages import (
    BeamSearchParams,
    DecodeConfig,
    ForcedPrefix,
    GroupId,
    ReasoningParams,
    ReturnMode,
    StageGroupOut,
    StageSpan,
)

PosInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]


class SamplingParamsBody(Struct, kw_only=True, forbid_unknown_fields=True):
    # 0: prefill only (prompt scoring with logprob_start_len, or warming the prefix cache);
    # unset: the catalog's depth for catalog beams, else SGLang's 128, within --max-new-tokens
    # and the context left (server/translation/length_default.py)
    max_new_tokens: Annotated[int, Meta(ge=0)] | None = None
    # grctl's form: n is the beam width, every beam returned. SGLang's: beam_width W searches W
    # beams and returns the best n <= W.
    n: PosInt = 1
    beam_width: PosInt | None = None
    temperature: Annotated[float, Meta(ge=0.0)] = 0.0  # > 0 with several beams: distinct samples
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1  # -1: the whole vocabulary
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name of seed
    stop_token_ids: list[TokenId] | None = None
    stop: str | list[str] | None = None  # stop strings: one beam, needs a tokenizer
    ignore_eos: bool = False
    min_new_tokens: Annotated[int, Meta(ge=0)] = 0
    length_penalty: float = 0.0  # deterministic beams: score / length ** length_penalty
    skip_special_tokens: bool | None = None  # text only; None: the tokenizer's default
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool = False  # keep the matched stop token or string in text
    use_catalog: bool = True  # false: not constrained to the served item catalog
    exclude_item_ids: list[int | str] | None = None  # no beam completes these catalog items
    # how a beam that completed a catalog item reports it: SGLang's "stop" (with item_id), or
    # grctl's own "item_complete"
    item_finish_reason: Literal["stop", "item_complete"] = "stop"
    # the prompt's last k tokens begin the item to complete (0: a new item); unset: the
    # catalog's rule (docs/catalog.md "Partial items")
    item_prefix_len: Annotated[int, Meta(ge=0)] | None = None
    logits_processors: list[Any] | None = None  # also accepted at the top level
    # SGLang knobs grctl does not implement: a 400 naming them unless they hold the value that
    # changes nothing (server/translation/sampling.py)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    stop_regex: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: Any = None
    custom_params: Any = None
    watermark: Any = None
    choice: Any = None
    stream_interval: Any = None  # no streaming: nothing to pace
    # multi-stage requests (protocol/stages.py, docs/http-api.md "Multi-stage requests"):
    # grctl's spelling
    reasoning: ReasoningParams | None = None
    forced_prefix: ForcedPrefix | None = None
    beam_return_mode: ReturnMode | None = None
    beam_group_id: GroupId | None = None
    beam_index: Annotated[int, Meta(ge=0)] | None = None
    # verl-GR's spelling, and its legacy aliases (verl_gr/workers/rollout/beam_config.py)
    enable_two_stage_rollout: bool | None = None
    decode_config: DecodeConfig | None = None
    beam_search_params: BeamSearchParams | None = None
    return_all_beams: bool | None = None
    stage2_beam_size: PosInt | None = None
    beam_idx: Annotated[int, Meta(ge=0)] | None = None
    two_stage_group_id: GroupId | None = None
    stage2_num_tokens: PosInt | None = None
    stage2_max_tokens: PosInt | None = None
    stage1_max_tokens: PosInt | None = None
    stage2_temperature: Annotated[float, Meta(ge=0.0)] | None = None
    stage2_top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stage2_top_k: Annotated[int, Meta(ge=-1)] | None = None


class GenerateBody(Struct, kw_only=True):
    # One prompt [S], or a batch [[S], ...] answered by a list of replies in order (SGLang).
    input_ids: list[TokenId | list[TokenId]] | None = None
    text: str | list[str] | None = None  # needs a tokenizer in the model directory
    # One for all prompts of a batch, or one per prompt.
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    return_logprob: bool = False  # every returned beam's output_token_logprobs
    top_logprobs_num: Annotated[int, Meta(ge=0)] = 0  # with return_logprob: output_top_logprobs
    # with return_logprob: input_token_logprobs of the prompt's tokens from this index on (the
    # first entry's logprob is null); -1 (or the prompt's length): none. One, or one per prompt.
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False  # each logprob entry's text: its token decoded
    rid: str | list[str] | None = None  # a batch takes a list, one id per prompt
    request_id: str | None = None  # alias of rid (one prompt)
    stream: bool = False  # streaming is not supported: true is a 400
    # [{"type": "token_suppress" | "token_bias", ...}] (grctl/engine/search/logits_processors.py)
    logits_processors: list[Any] | None = None
    # logprobs are the sampling distribution's; true: the model's log_softmax(logits) (null:
    # the server's --return-original-logprob)
    return_original_logprob: bool | None = None
    # SGLang's: each output token's sampling support and its log-probabilities
    return_sampling_mask: bool = False
    sampling_logprobs_mode: Literal["selected", "support"] | None = None  # null: "selected"
    # SGLang fields grctl does not implement: a 400 naming them when set
    token_ids_logprob: Any = None
    return_hidden_states: Any = None
    custom_logit_processor: Any = None
    lora_path: Any = None


class SubmitManyBody(Struct, kw_only=True):
    requests: list[GenerateBody] = msgspec.field(default_factory=list)


class CancelBody(Struct, kw_only=True):
    request_id: str | None = None
    rid: str | None = None  # alias of request_id


class AbortRequestBody(Struct, kw_only=True):
    rid: str | None = None
    abort_all: bool = False


class FinishReason(Struct, kw_only=True, omit_defaults=True):
    # "length" | "stop" | "abort", or "item_complete" where sampling_params.item_finish_reason
    # asks for it, or "no_item" (a catalog request no item was reachable for: no beams); the
    # server always sends one
    type: str = ""
    matched: int | str | None = None  # the stop token or string, when a stop token ended it
    length: int | None = None  # the number of generated tokens, when type == "length"
    item_id: int | str | None = None  # the catalog item the beam completed (its first id)


# SGLang's shape: one [logprob, token_id, token_text] per token; text null unless
# return_text_in_logprobs
LogprobEntry = tuple[float, int, str | None]
# input_token_logprobs: the same, but the first prompt token scored has no logprob (null)
InputLogprobEntry = tuple[float | None, int, str | None]


class WeightVersionSpan(Struct, kw_only=True):
    """Output tokens [start, end) were computed with weights `version` (SGLang's
    meta_info.weight_versions entry): spans are contiguous from 0, neighbours differ."""

    version: str = ""
    start: int = 0
    end: int = 0


class BeamMetaInfo(Struct, kw_only=True, omit_defaults=True):
    sequence_score: float = 0.0  # cumulative log-probability of output_ids (after processors)
    finish_reason: FinishReason | None = None
    # beam_width form: beam 0 carries the completion tokens of every returned beam (SGLang)
    completion_tokens: int | None = None
    # this beam's, with return_logprob (a multi-stage beam's forced tokens: logprob null)
    output_token_logprobs: list[InputLogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry]] | None = None  # with top_logprobs_num
    weight_versions: list[WeightVersionSpan] | None = None  # over this beam's output_ids
    # log q(beam): the sum of its tokens' log-probabilities under the sampling distribution
    sampling_logprob: float | None = None
    # stochastic beams (temperature > 0, width > 1): the Gumbel key it was drawn by, and its
    # rank among the returned keys (0: the largest)
    gumbel_key: float | None = None
    draw_order: int | None = None
    # with return_sampling_mask (SGLang's shape): per token the support, best first, and the
    # chosen token's log-probability ("selected") or the support's ("support")
    output_token_sampling_mask: list[list[int]] | None = None
    output_token_sampling_logprobs: list[Any] | None = None
    output_token_sampling_mask_length: int | None = None
    # with sampling_params.custom_params.return_top_p_token_ids (slime's top-p replay): every
    # token's support flattened, and its offsets (token t's: ids[offsets[t]:offsets[t + 1]])
    top_p_token_ids: list[int] | None = None
    top_p_token_offsets: list[int] | None = None
    # a multi-stage beam (output_ids: reasoning + forced prefix + item): its group, its rank
    # in it, which positions were sampled, forced or searched, and each token's behaviour
    # logprob (null where forced)
    group_id: str | None = None
    group_index: int | None = None
    beam_index: int | None = None
    stage_spans: list[StageSpan] | None = None
    behaviour_logprobs: list[float | None] | None = None


class StrictBeamMetaInfo(BeamMetaInfo, kw_only=True, omit_defaults=True):
    """What the server sends for a beam: these keys always, the optional ones when set."""

    sequence_score: float
    finish_reason: FinishReason | None


class BeamOut(Struct, kw_only=True):
    output_ids: list[int] = msgspec.field(default_factory=list)
    text: str | None = None  # decoded with a tokenizer, else the ids joined by spaces
    meta_info: BeamMetaInfo = msgspec.field(default_factory=BeamMetaInfo)


class MetaInfo(Struct, kw_only=True):
    id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason = msgspec.field(default_factory=FinishReason)
    weight_version: str = ""  # the version of the last output token (of the top beam)
    weight_versions: list[WeightVersionSpan] = msgspec.field(default_factory=list)  # output_ids'
    num_retractions: int = 0  # times a retract pause sent it back to the queue (SGLang)
    beam_width: int = 1
    beam_results: list[BeamOut] = msgspec.field(default_factory=list)
    e2e_latency: float = 0.0
    # retracted, then a weight write dropped its KV: the output lengths at which its prompt and
    # generated tokens were computed again under the weights of that time
    kv_recomputed_at: list[int] | None = None
    sequence_score: float | None = None  # beam_width form: beam 0's (SGLang)
    # the top beam's, with return_logprob; every beam's own under beam_results
    output_token_logprobs: list[InputLogprobEntry] | None = None
    output_token_logprobs_length: int | None = None
    output_top_logprobs: list[list[LogprobEntry]] | None = None  # with top_logprobs_num
    # with return_logprob: the prompt's tokens from logprob_start_len on ([] without it), and
    # with top_logprobs_num their top logprobs (null for the first)
    input_token_logprobs: list[InputLogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    # with an item catalog: one row per beam, in beam order, and the catalog's version
    item_results: list[ItemResultOut] | None = None
    catalog_version: int | None = None
    item_prefix_len: int | None = None  # with a catalog: the prompt tokens its item resumed
    # the exclude_item_ids the catalog holds no item of (each excluded nothing), as sent
    unknown_exclude_item_ids: list[int | str] | None = None
    # stochastic beams: the (k+1)-th largest Gumbel key of the search, k the beams returned;
    # null when fewer than k + 1 sequences could be drawn (the whole support was); absent for
    # other requests and for an aborted one (finish_reason abort: no estimator applies)
    gumbel_threshold: float | None | UnsetType = UNSET
    # with return_sampling_mask: the top beam's (SGLang's shape)
    output_token_sampling_mask: list[list[int]] | None = None
    output_token_sampling_logprobs: list[Any] | None = None
    output_token_sampling_mask_length: int | None = None
    # with custom_params.return_top_p_token_ids: the top beam's (slime's keys, as above)
    top_p_token_ids: list[int] | None = None
    top_p_token_offsets: list[int] | None = None
    # multi-stage requests: one entry per reasoning sample (a group), the restarts summed, and
    # with beam_group_id the group and the beam index this reply serves
    stage_groups: list[StageGroupOut] | None = None
    stage_restarts: int | None = None
    beam_group_id: str | None = None
    beam_index: int | None = None


class StrictMetaInfo(MetaInfo, kw_only=True, omit_defaults=True):
    """The meta_info the server sends: these keys always; the optional ones only when set."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    weight_version: str
    weight_versions: list[WeightVersionSpan]
    num_retractions: int
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
