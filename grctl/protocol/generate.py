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


def doc(text: str) -> Meta:
    """A field's description: the OpenAPI schema's (/docs), and its one account here."""
    return Meta(description=text)


TokenId = Annotated[int, Meta(ge=0)]


class SamplingParamsBody(Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        doc(
            "Tokens to generate, 0 to --max-new-tokens; 0 prefills only (prompt scoring, "
            "cache warming). Unset: the catalog's depth for catalog beams, else 128 "
            "(SGLang's), within --max-new-tokens and the context left."
        ),
    ] = None
    n: Annotated[
        PosInt,
        doc(
            "grctl's form (no beam_width): the beam width, every beam returned (n samples "
            "under --parallel-sampling). With beam_width: how many of its beams are "
            "returned."
        ),
    ] = 1
    beam_width: Annotated[
        PosInt | None,
        doc("SGLang's beam form: search this many beams, return the best n (n <= beam_width)."),
    ] = None
    temperature: Annotated[
        Annotated[float, Meta(ge=0.0)],
        doc(
            "0: greedy / deterministic beams. > 0: sampled; several beams are distinct "
            "samples without replacement (Gumbel top-k). At most 100."
        ),
    ] = 0.0
    top_p: Annotated[
        Annotated[float, Meta(gt=0.0, le=1.0)],
        doc("Nucleus filter on the tempered distribution, in (0, 1]; 1: off."),
    ] = 1.0
    top_k: Annotated[
        Annotated[int, Meta(ge=-1)],
        doc("Keep the k most likely tokens; -1 (or 1 << 30): the whole vocabulary."),
    ] = -1
    min_p: Annotated[
        Annotated[float, Meta(ge=0.0, le=1.0)],
        doc("Drop tokens below min_p times the top token's probability, in [0, 1]; 0: off."),
    ] = 0.0
    seed: Annotated[
        int | None,
        doc(
            "The request's own generator: the same seed gives the same samples in any "
            "batch. Unset: random."
        ),
    ] = None
    sampling_seed: Annotated[
        int | None,
        doc("SGLang's name of seed."),
    ] = None
    stop_token_ids: Annotated[
        list[TokenId] | None,
        doc("Extra tokens that end a sequence (the model's EOS ends one too unless ignore_eos)."),
    ] = None
    stop: Annotated[
        str | list[str] | None,
        doc("Stop strings (one, or up to 32); one beam only; needs the server's tokenizer."),
    ] = None
    ignore_eos: Annotated[
        bool,
        doc("Run to max_new_tokens whatever EOS or stop_token_ids say."),
    ] = False
    min_new_tokens: Annotated[
        Annotated[int, Meta(ge=0)],
        doc(
            "No stop token or catalog item ends a sequence before this many tokens; under a"
            " catalog, prefixes whose every item is shorter are closed."
        ),
    ] = 0
    length_penalty: Annotated[
        float,
        doc(
            "Deterministic beams: finished beams rank by score / length ** length_penalty, "
            "in [-10, 10]; 0: off."
        ),
    ] = 0.0
    skip_special_tokens: Annotated[
        bool | None,
        doc("Leave special tokens out of text. Unset: the tokenizer's default."),
    ] = None
    spaces_between_special_tokens: Annotated[
        bool | None,
        doc("Spaces between special tokens in text. Unset: the tokenizer's default."),
    ] = None
    no_stop_trim: Annotated[
        bool,
        doc("Keep the matched stop token or string in text."),
    ] = False
    use_catalog: Annotated[
        bool,
        doc(
            "Constrain beams to the served item catalog (when the server has one); false: "
            "free generation."
        ),
    ] = True
    exclude_item_ids: Annotated[
        list[int | str] | None,
        doc(
            "Catalog items no beam may complete (a user's history); ids naming no item are "
            "listed in meta_info.unknown_exclude_item_ids."
        ),
    ] = None
    item_finish_reason: Annotated[
        Literal["stop", "item_complete"],
        doc(
            "How a beam that completed an item reports it: SGLang's 'stop' (with item_id) "
            "or grctl's 'item_complete'."
        ),
    ] = "stop"
    item_prefix_len: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        doc(
            "The prompt's last k tokens begin the item to complete (0: a new item). Unset: "
            "the catalog's rule."
        ),
    ] = None
    logits_processors: Annotated[
        list[Any] | None,
        doc("token_suppress / token_bias processors (also accepted at the top level)."),
    ] = None
    # SGLang knobs grctl does not implement: a 400 naming them unless they hold the value that
    # changes nothing (server/translation/sampling.py)
    frequency_penalty: Annotated[
        Any,
        doc("SGLang's; not implemented by grctl: only 0 (or null) is accepted."),
    ] = None
    presence_penalty: Annotated[
        Any,
        doc("SGLang's; not implemented by grctl: only 0 (or null) is accepted."),
    ] = None
    repetition_penalty: Annotated[
        Any,
        doc("SGLang's; not implemented by grctl: only 1 (or null) is accepted."),
    ] = None
    stop_regex: Annotated[
        Any,
        doc("SGLang's; not implemented by grctl: only an empty value (or null) is accepted."),
    ] = None
    json_schema: Annotated[
        Any,
        doc(
            "SGLang's grammar; not implemented by grctl: only an empty value (or null) is accepted."
        ),
    ] = None
    regex: Annotated[
        Any,
        doc(
            "SGLang's grammar; not implemented by grctl: only an empty value (or null) is accepted."
        ),
    ] = None
    ebnf: Annotated[
        Any,
        doc(
            "SGLang's grammar; not implemented by grctl: only an empty value (or null) is accepted."
        ),
    ] = None
    structural_tag: Annotated[
        Any,
        doc(
            "SGLang's grammar; not implemented by grctl: only an empty value (or null) is accepted."
        ),
    ] = None
    logit_bias: Annotated[
        Any,
        doc(
            "SGLang's; not implemented here (use logits_processors' token_bias): only {} "
            "(or null) is accepted."
        ),
    ] = None
    custom_params: Annotated[
        Any,
        doc(
            "SGLang's object for engine-specific fields: any sampling_params field here, "
            "read as if set beside the others (the form that crosses gateways); also "
            "return_top_p_token_ids."
        ),
    ] = None
    watermark: Annotated[
        Any,
        doc("SGLang's; not implemented by grctl: only {} (or null) is accepted."),
    ] = None
    choice: Annotated[
        Any,
        doc("Not implemented by grctl: only an empty value (or null) is accepted."),
    ] = None
    stream_interval: Annotated[
        Any,
        doc("SGLang's streaming pace; ignored (no streaming)."),
    ] = None
    # multi-stage requests (protocol/stages.py, docs/http-api.md "Multi-stage requests"):
    # grctl's spelling
    reasoning: Annotated[
        ReasoningParams | None,
        doc(
            "Multi-stage (grctl's spelling): stage 1 sampling before the forced prefix and "
            "the item beams."
        ),
    ] = None
    forced_prefix: Annotated[
        ForcedPrefix | None,
        doc(
            "Multi-stage: the text or ids appended after each reasoning sample, before the "
            "item stage."
        ),
    ] = None
    beam_return_mode: Annotated[
        ReturnMode | None,
        doc("Multi-stage: all_beams (every beam of the group) or best_only (one)."),
    ] = None
    beam_group_id: Annotated[
        GroupId | None,
        doc(
            "Multi-stage: the group whose beams this request shares (computed once, served "
            "one beam_index per call)."
        ),
    ] = None
    beam_index: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        doc("Multi-stage: which beam of the beam_group_id group this reply serves."),
    ] = None
    # verl-GR's spelling, and its legacy aliases (verl_gr/workers/rollout/beam_config.py)
    enable_two_stage_rollout: Annotated[
        bool | None,
        doc("verl-GR's spelling: run the request in two stages."),
    ] = None
    decode_config: Annotated[
        DecodeConfig | None,
        doc("verl-GR's spelling: reasoning and item_generation phases."),
    ] = None
    beam_search_params: Annotated[
        BeamSearchParams | None,
        doc("verl-GR's spelling: the item stage's beam search."),
    ] = None
    return_all_beams: Annotated[
        bool | None,
        doc("verl-GR's legacy alias of beam_return_mode all_beams."),
    ] = None
    stage2_beam_size: Annotated[
        PosInt | None,
        doc("verl-GR's legacy alias of beam_width for the item stage."),
    ] = None
    beam_idx: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        doc("verl-GR's legacy alias of beam_index."),
    ] = None
    two_stage_group_id: Annotated[
        GroupId | None,
        doc("verl-GR's legacy alias of beam_group_id."),
    ] = None
    stage2_num_tokens: Annotated[
        PosInt | None,
        doc("verl-GR's legacy alias of the item stage's max_tokens."),
    ] = None
    stage2_max_tokens: Annotated[
        PosInt | None,
        doc("verl-GR's legacy alias of the item stage's max_tokens."),
    ] = None
    stage1_max_tokens: Annotated[
        PosInt | None,
        doc("verl-GR's legacy alias of the reasoning stage's max_tokens."),
    ] = None
    stage2_temperature: Annotated[
        Annotated[float, Meta(ge=0.0)] | None,
        doc("verl-GR's legacy alias of the item stage's temperature."),
    ] = None
    stage2_top_p: Annotated[
        Annotated[float, Meta(gt=0.0, le=1.0)] | None,
        doc("verl-GR's legacy alias of the item stage's top_p."),
    ] = None
    stage2_top_k: Annotated[
        Annotated[int, Meta(ge=-1)] | None,
        doc("verl-GR's legacy alias of the item stage's top_k."),
    ] = None


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
