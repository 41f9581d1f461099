"""What the engine takes and gives back (plain dataclasses, no HTTP in here), and request ids."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from grctl.engine.search.beam import BeamResult
from grctl.engine.search.params import SamplingParams

_ID_PREFIX = f"req-{uuid.uuid4().hex[:8]}-{os.getpid()}"
_ID_COUNT = itertools.count()


def new_request_id() -> str:
    """An id no other request of this process has (nor, by its random prefix, of another)."""
    return f"{_ID_PREFIX}-{next(_ID_COUNT)}"


@dataclass(frozen=True)
class TextOptions:
    """How the server spells a result (its text, its finish reasons); the engine only carries
    them to the result."""

    skip_special_tokens: bool | None = None  # None: the tokenizer's own default
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool = False  # keep a matched stop string in `text`
    return_text_in_logprobs: bool = False  # each logprob entry's text: the token decoded
    item_finish_reason: str = "stop"  # a completed catalog item: "stop" or "item_complete"
    # with return_sampling_mask: "selected" (the chosen token's logprob) or "support" (each)
    sampling_logprobs_mode: str = "selected"
    # the forms in which the reply spells each token's sampling support (when the request had it
    # computed): SGLang's output_token_sampling_mask fields, and slime's flattened top-p ids
    sampling_mask: bool = True
    top_p_token_ids: bool = False


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    return_logprob: bool = False
    request_id: str | None = None  # None: the engine assigns one
    top_logprobs_num: int = 0  # with return_logprob: the k most likely tokens at each step
    # with return_logprob: score the prompt's tokens from this index on (-1: none); SGLang's
    logprob_start_len: int = -1
    # report the model's log_softmax(logits), not the behaviour policy's; None: the server's
    return_original_logprob: bool | None = None
    return_sampling_mask: bool = False  # each token's sampling support and its logprobs
    # ids -> text, the server's tokenizer: what sampling.stop strings are matched against
    detokenize: Callable[[list[int]], str] | None = None
    text: TextOptions = TextOptions()
    # width 1: keep its prompt + output KV in the prefix cache when it ends (engine/output_kv.py)
    keep_output_kv: bool = False


@dataclass
class ItemResult:
    """One beam read against the catalog the request was served with."""

    rank: int
    token_ids: list[int]
    item_ids: list[int | str]  # every item on this path (several: a collision)
    is_complete: bool  # the path ends at an item
    score: float

    @property
    def item_id(self) -> int | str | None:
        return self.item_ids[0] if self.item_ids else None


@dataclass
class PromptLogprobs:
    """A prompt's tokens from logprob_start_len on, each with the model's log-probability of it
    given the tokens before it (the raw distribution: temperature 1, no catalog mask); the first
    has none (None), as SGLang reports it."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[float, int]] | None] | None = None  # with top_logprobs_num


@dataclass
class GenerateResult:
    request_id: str
    prompt_tokens: int
    output_ids: list[int]  # the top sequence
    finish_reason: str  # "length" | "stop" | "item_complete" | "abort" | "no_item" (beam.py)
    matched_stop: int | str | None  # the stop token (or string) that ended the top sequence
    beams: list[BeamResult]  # the returned beams, best first (each with its logprobs, when asked)
    weight_version: str  # the version the request finished on
    weight_versions: list[str]  # every version its tokens were computed with, in order
    # the version of each output position, for every beam alike (beams advance together)
    token_versions: list[str] = field(default_factory=list)
    num_retractions: int = 0  # times a retract pause sent it back to the queue
    kv_recomputed_at: list[int] = field(default_factory=list)  # see Sequence.kv_recomputed_at
    output_token_logprobs: list[float] | None = None  # the top sequence's, when asked
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # with return_logprob and logprob_start_len
    latency_s: float = 0.0
    item_results: list[ItemResult] | None = None  # with a catalog: one per beam, in beam order
    catalog_version: int | None = None  # the catalog version the request was served with
    item_prefix_len: int | None = None  # with a catalog: prompt tokens its item resumed from
    beam_width: int | None = None  # SGLang's form was asked: the width searched
    # stochastic beams: the (k+1)-th largest Gumbel key (None: the whole support was drawn)
    gumbel_threshold: float | None = None
    text: TextOptions = field(default_factory=TextOptions)  # the request's
    unknown_exclude_item_ids: list = field(default_factory=list)  # sent, naming no item
    extra: dict = field(default_factory=dict)

    def version_spans(self, num_tokens: int) -> list[tuple[str, int, int]]:
        """(version, start, end) over the first `num_tokens` output positions: half-open,
        contiguous, two neighbours never of one version (SGLang's weight_versions spans). No
        token: one empty span of the version it finished on."""
        spans: list[tuple[str, int, int]] = []
        for t, version in enumerate(self.token_versions[:num_tokens]):
            if spans and spans[-1][0] == version:
                spans[-1] = (version, spans[-1][1], t + 1)
            else:
                spans.append((version, t, t + 1))
        return spans or [(self.weight_version, 0, 0)]

    @property
    def completion_tokens(self) -> int:
        return sum(len(b.output_ids) for b in self.beams) or len(self.output_ids)
