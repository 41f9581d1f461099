"""Multi-stage requests on the wire (docs/http-api.md "Multi-stage requests"): reason, then
recommend, in one request under one weight version.

A request is multi-stage when its sampling_params carry `reasoning` (grctl's spelling) or any of
verl-GR's two-stage keys (`decode_config`, `beam_search_params`, `beam_group_id`, `beam_index`,
`beam_return_mode`, `enable_two_stage_rollout` and verl-GR's legacy aliases). Stage 1 samples
the reasoning, a forced prefix follows, and stage 2 searches beams over the catalog (or free
beams) from the context of what came before. The reply's parts are below; the bodies' fields
live on SamplingParamsBody (generate.py), which holds these Structs.
"""

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

PosInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]
# bounded here so that a body cannot ask the server to hold an unbounded group
MAX_GROUP_ID_LEN = 256


class ReasoningParams(Struct, kw_only=True, forbid_unknown_fields=True):
    """grctl's spelling of stage 1: `n` reasoning samples per prompt, each a GRPO group of the
    item beams that continue it."""

    n: Annotated[int, Meta(ge=1, le=256)] = 1
    # unset: SGLang's 128 within --max-new-tokens and the context left (length_default.py)
    max_new_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0  # 0: greedy reasoning
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None  # sample i draws with seed + i; None: random
    stop: str | list[str] | None = None  # e.g. "</think>"; needs the server's tokenizer
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_new_tokens: Annotated[int, Meta(ge=0)] = 0
    # text only: the tokens that matched a stop string are always part of the response ids
    include_stop_str_in_output: bool = True


class ForcedPrefix(Struct, kw_only=True, forbid_unknown_fields=True):
    """Tokens appended after the reasoning, before the item beams (e.g. "\\n<|sid_begin|>"):
    one of text (tokenized without special tokens added) or ids."""

    text: str | None = None
    ids: list[TokenId] | None = None


class BeamSearchParams(Struct, kw_only=True, forbid_unknown_fields=True):
    """verl-GR's beam_search_params (verl_gr/workers/rollout/beam_config.py)."""

    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    length_penalty: float | None = None  # verl-GR's default 1.0
    ignore_eos: bool | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None  # verl-GR's default 0: beams
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None


class DecodePhase(Struct, kw_only=True, forbid_unknown_fields=True):
    """One of verl-GR's decode_config phases (reasoning or item_generation)."""

    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool | None = None
    prefix_text: str | None = None  # item_generation only


class DecodeConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    reasoning: DecodePhase | None = None
    item_generation: DecodePhase | None = None


StageKind = Literal["sampled", "forced", "searched"]
ReturnMode = Literal["all_beams", "all", "best_only", "best"]
GroupId = Annotated[str, Meta(min_length=1, max_length=MAX_GROUP_ID_LEN)]


class StageSpan(Struct, kw_only=True):
    """Response positions [start, end) were `kind`: sampled (the reasoning), forced (the
    prefix: no behaviour logprob) or searched (the item beams)."""

    kind: str = ""
    start: int = 0
    end: int = 0


class StageGroupOut(Struct, kw_only=True):
    """One reasoning sample and the beams that continue it: a GRPO group."""

    group_id: str = ""
    index: int = 0  # the reasoning sample's index among the prompt's n
    reasoning_ids: list[int] = msgspec.field(default_factory=list)
    reasoning_logprob: float = 0.0  # its behaviour log-probability, summed
    # how stage 1 ended: "stop" (a stop string or token: `reasoning_matched`), "length"
    reasoning_finish_reason: str = ""
    reasoning_matched: int | str | None = None
    prefix_ids: list[int] = msgspec.field(default_factory=list)
    num_beams: int = 0  # beams the item stage returned for it
    weight_version: str = ""  # every token of the group's: one version
    restarts: int = 0  # times a weight write between or inside its stages restarted it
    # the prompt (and reasoning) tokens its item stage found cached instead of prefilling
    cached_tokens: int = 0
    # stochastic item beams: the (k+1)-th largest Gumbel key of its search (null: the whole
    # support was drawn); absent for deterministic beams
    gumbel_threshold: float | None | UnsetType = UNSET
