"""Beams: one request's search, and the step states it reads its beams from.

A request searches `width` beams (n, or SGLang's beam_width). Deterministic beams (temperature
0) keep what transformers' `generate(num_beams=w, early_stopping="never")` keeps: w running
beams and a pool of the w best finished ones, ranked by cumulative log-probability (divided by
length ** length_penalty in the pool). Each step (beam_select.py) ranks the K best expansions
(K = w * max(2, 1 + stop tokens), transformers' `beams_to_keep`; K = w when nothing can end
early); a candidate that ends its sequence (a stop token, a completed catalog item, the last
allowed token) joins the pool only if it ranks among the first w, and the first w that do not
end run on. Stochastic beams (temperature > 0) rank by their Gumbel keys (sampler.py), and the
w largest keys among the pool and the candidates are kept, the finished ones in the pool, so
the pool ends as w distinct sequences drawn without replacement (width 1: one sample). A dead
beam has key -inf and is never returned.

The search ends when no beam runs, at max_new_tokens, or, deterministic, when the pool is full
and no running beam can beat its worst entry (log-probabilities only fall, so stopping there
changes no result).

Every beam carries phi, its log-probability under the behaviour policy (the distribution its
tokens were drawn from or searched over: sampler.py's, renormalised over what the step allowed;
at T = 0 the processed log-probabilities renormalised, without filters), returned as its
sampling_logprob. A stochastic search (width > 1) also returns each beam's Gumbel key, its rank
among the returned keys (draw_order) and the threshold: the largest key of any sequence not
returned, which is the largest key any step dropped (the w largest keys pass from each step to
the next unchanged: a prefix's key is its best child's), or the (n+1)-th returned key when
beam_width searches more than the n returned; None when nothing finite was dropped (the whole
support was drawn).

Every step writes one StepState for all the requests it advanced, padded to [R, N]; a request
holds (state, row) for its last step and for each earlier one (its history: the token, the
parent beam and the reported log-probability of every running beam), so nothing of a beam's
past is copied when beams reorder. beam_results.walk reads the returned beams back, once, on
the host.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grctl.engine.search.logits_processors import PHASES, LogitsRule, TokenEdits
from grctl.engine.search.params import SamplingParams

if TYPE_CHECKING:
    from grctl.catalog.trie import Trie

# reason codes of finished beams; 0: not finished, -1: still running when aborted
STOP, ITEM, LENGTH, STOP_STRING = 1, 2, 3, 4
REASONS = {STOP: "stop", ITEM: "item_complete", LENGTH: "length", STOP_STRING: "stop"}
# a catalog request's finish when its search returned no beam: no item its constraints
# (min_new_tokens, exclude_item_ids, processors, item_prefix) allow is reachable; not an abort
NO_ITEM = "no_item"
NEG_INF = float("-inf")

# columns of StepState's packed tensors
SCORE, KEY, PHI, LP = 0, 1, 2, 3  # run_f and pool_f
NODE, TOKEN, PARENT = 0, 1, 2  # run_i; pool_i adds LENGTH_COL and REASON_COL
LENGTH_COL, REASON_COL = 3, 4


@dataclass
class BeamResult:
    output_ids: list[int]
    sequence_score: float  # cumulative log-probability of output_ids (after the processors)
    finish_reason: str  # "length" | "stop" | "item_complete" | "abort"
    # each token's reported log-probability: the behaviour policy's, or with original_logprob
    # the model's own log_softmax(logits)
    output_token_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None  # per token, best first
    node: int = 0  # the catalog trie node the beam reached (0: none)
    matched_stop: int | str | None = None  # the stop token or string that ended it
    sampling_logprob: float = 0.0  # log q(beam): the sum of its behaviour log-probabilities
    gumbel_key: float | None = None  # stochastic beams (width > 1): the key it was ranked by
    draw_order: int | None = None  # and its rank among the returned keys (0: the largest)
    # with sampling_mask: per token, the behaviour policy's support (best first) and its
    # log-probabilities; None at a step whose support exceeded the cap (mask_overflow)
    sampling_mask: list[list[int]] | None = None
    sampling_mask_logprobs: list[list[float]] | None = None
    mask_overflow: bool = False


@dataclass(eq=False)
class StepState:
    """One step's beams of every request it advanced, row i of each tensor for request i:
    run_f [R, N, 4] (score, key, phi, lp), run_i [R, N, 3] (node, token, parent), pool_f
    [R, N, 4] (score, key, phi, lp), pool_i [R, N, 5] (node, token, parent, length, reason);
    dropped [R], the largest key the step dropped (stochastic beams; else -inf). Per row of the
    step's logits (request i's rows from first_rows[i], one per parent beam), when asked: the
    top log-probabilities ([rows, k] values and ids). The sampling support is not here: each
    request that asks keeps its own rows of it (Beams.mask_history)."""

    run_f: torch.Tensor
    run_i: torch.Tensor
    pool_f: torch.Tensor
    pool_i: torch.Tensor
    dropped: torch.Tensor | None = None
    first_rows: list[int] | None = None
    rows_top: tuple[torch.Tensor, torch.Tensor] | None = None
    # rows_top holds only the requests that ask (and only they are computed): request i's rows
    # from top_first_rows[i] (-1: none)
    top_first_rows: list[int] | None = None


class Beams:
    def __init__(
        self,
        params: SamplingParams,
        stop_ids: tuple[int, ...],
        vocab_size: int,
        device: torch.device,
        trie: Trie | None = None,  # the catalog's trie constraining every step
        banned: torch.Tensor | None = None,  # sorted trie nodes no beam may enter
        top_logprobs: int = 0,
        original_logprob: bool = False,  # report log_softmax(logits), not the behaviour's
        report_logprobs: bool = True,  # False: nobody reads the token logprobs
        sampling_mask: int = 0,  # > 0: keep each token's support, up to this many - 1 tokens
        start: tuple[int, int] = (0, 0),  # the trie node and depth a partial item resumes at
    ):
        self.params = params
        self.width = w = params.width
        self.num_return = params.n
        self.max_new_tokens = params.max_new_tokens
        self.is_stochastic = params.is_stochastic
        self.trie = trie
        self.banned = banned
        self.start_node, self.start_depth = start
        self.stop_ids = stop_ids
        self.top_logprobs = top_logprobs
        self.original_logprob = original_logprob
        self.report_logprobs = report_logprobs
        self.is_gumbel = self.is_stochastic and w > 1
        self.wants_mask = sampling_mask > 0
        self.mask_width = sampling_mask if self.is_stochastic else 0  # T = 0: the token itself
        # transformers ranks w * max(2, 1 + stop tokens) candidates, so that w survive even
        # when some end early; with nothing that can end early the best w are all that is used.
        # Stochastic beams keep the w largest keys of pool and candidates, and rank w + 1: the
        # (w + 1)-th largest key of the step is the largest it drops (the threshold's part).
        can_end_early = bool(stop_ids) or trie is not None
        k = max(2, 1 + len(stop_ids)) * w if can_end_early and not self.is_stochastic else w
        k += self.is_gumbel
        self.num_candidates = min(k, w * vocab_size)
        self.gumbel_threshold: float | None = None  # set by beam_results.walk
        rules = params.logits_processors
        self.edits = {phase: TokenEdits.of(rules, phase) for phase in PHASES}
        # before min_new_tokens: the same, and no stop token
        no_stop = LogitsRule(tuple(stop_ids), (NEG_INF,) * len(stop_ids), is_bias=False)
        self.edits_short = {phase: TokenEdits.of((*rules, no_stop), phase) for phase in PHASES}
        self.generator: torch.Generator | None = None
        if self.is_stochastic:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed & (2**64 - 1))
        # the root's key, Gumbel(0) (log q = 0), drawn first: every sequence's key is then an
        # independent Gumbel(log q(y)), as the threshold's inclusion probabilities need
        self.root_key: torch.Tensor | None = None
        if self.is_gumbel:
            u = torch.rand(1, generator=self.generator, device=device)
            self.root_key = -torch.log(-torch.log(u.clamp(min=torch.finfo(u.dtype).tiny)))
        self.state: StepState | None = None
        self.row = 0
        self.history: list[tuple[StepState, int]] = []
        # with a sampling support asked (mask_width > 0): each step's support of this request's
        # rows only, [num_rows, min(vocab, mask_width)] values and token ids (row_tops.py)
        self.mask_history: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_steps = 0  # tokens chosen so far
        self.is_done = False
        self.stop_string: str | None = None

    @property
    def is_started(self) -> bool:
        return self.num_steps > 0

    @property
    def trie_depth(self) -> int:
        """The depth in the trie of the nodes the next step extends."""
        return self.start_depth + self.num_steps

    @property
    def num_rows(self) -> int:
        """Rows this request feeds the next step: its prefill row, then one per beam."""
        return self.width if self.is_started else 1

    def advance(self, state: StepState, row: int, is_over: bool, mask=None) -> None:
        self.state, self.row = state, row
        self.history.append((state, row))
        if mask is not None:
            self.mask_history.append(mask)
        self.num_steps += 1
        self.is_done = is_over or self.num_steps >= self.max_new_tokens

    def parents(self) -> torch.Tensor:
        """Each running beam's parent among the previous step's beams, [w]."""
        return self.state.run_i[self.row, : self.width, PARENT]

    def next_input(self) -> torch.Tensor:
        """The token each beam feeds next, [w] (a dead beam feeds a dummy 0)."""
        return self.state.run_i[self.row, : self.width, TOKEN].clamp(min=0)

    def last_tokens(self) -> torch.Tensor:
        return self.state.run_i[self.row, : self.width, TOKEN]

    def running_paths(self) -> torch.Tensor:
        """Every running beam's tokens so far, [w, num_steps] (a dead beam's are dummy 0s):
        each beam's own path, walked back through its parents."""
        hist = torch.stack([st.run_i[r, : self.width] for st, r in self.history])  # [T, w, 3]
        beam = torch.arange(self.width, device=hist.device)
        cols = []
        for t in range(self.num_steps - 1, -1, -1):
            cols.append(hist[t, beam, TOKEN])
            beam = hist[t, beam, PARENT].clamp(0, self.width - 1)
        return torch.stack(cols[::-1], 1).clamp(min=0)

    def finish_running(self, stop_string: str) -> None:
        """End a width-1 search on its running beam, matched by a stop string."""
        s, i = self.state, self.row
        s.pool_f[i, 0] = s.run_f[i, 0]
        s.pool_i[i, 0, :3] = s.run_i[i, 0]
        s.pool_i[i, 0, LENGTH_COL] = self.num_steps
        s.pool_i[i, 0, REASON_COL] = STOP_STRING
        self.stop_string = stop_string
        self.is_done = True
