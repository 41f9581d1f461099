"""Beams: one request's search state on the device, and how a step's candidates update it.

Beam search of width n keeps what transformers' `generate(num_beams=n, length_penalty=0,
early_stopping=False)` keeps: n running beams and a pool of the n best finished ones, scored by
cumulative log-probability. Each step (beam_select.py) ranks the K best expansions of the running
beams (K = n * max(2, 1 + stop tokens), transformers' `beams_to_keep`; K = n when no beam can
end before the last step). A candidate that ends its sequence (a stop token, a completed catalog
item, or the last allowed token) joins the pool only if it ranks among the first n; the first n
candidates that do not end become the running beams. A request short of n valid catalog paths
has fewer beams: a dead beam has score -inf and is never returned. n == 1 is the same with
K = 1 and a Sampler choosing the token. The search ends when no beam runs, at max_new_tokens,
or when the pool is full and no running beam can beat its worst entry (log-probabilities only
fall, so stopping there changes no result).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grctl.engine.search.sampler import Sampler

if TYPE_CHECKING:
    from grctl.catalog.trie import Trie

# reason codes of finished beams; 0: not finished
STOP, ITEM, LENGTH = 1, 2, 3
REASONS = {STOP: "stop", ITEM: "item_complete", LENGTH: "length"}
NEG_INF = float("-inf")


@dataclass
class BeamResult:
    output_ids: list[int]
    sequence_score: float  # cumulative log-probability of output_ids
    finish_reason: str  # "length" | "stop" | "item_complete" | "abort"


class Beams:
    def __init__(
        self,
        num_beams: int,
        max_new_tokens: int,
        stop_ids: tuple[int, ...],
        device: torch.device,
        vocab_size: int,
        sampler: Sampler | None = None,
        trie: Trie | None = None,  # the catalog's trie constraining every step
    ):
        n, t = num_beams, max_new_tokens
        self.num_beams = n
        self.max_new_tokens = t
        self.sampler = sampler  # n == 1 only
        self.trie = trie
        self.stop_ids = stop_ids
        self.stop_tensor = torch.tensor(stop_ids, dtype=torch.int64, device=device)
        # transformers ranks n * max(2, 1 + stop tokens) candidates, so that n survive even when
        # some end early; with no stop token and no catalog nothing ends before the last step,
        # and the best n are all that is ever used
        can_end_early = bool(stop_ids) or trie is not None
        width = max(2, 1 + len(stop_ids)) * n if can_end_early else n
        self.num_candidates = 1 if n == 1 else min(width, n * vocab_size)
        self.tokens = torch.full((n, t), -1, dtype=torch.int64, device=device)  # -1: none
        self.token_logprobs = torch.zeros((n, t), dtype=torch.float32, device=device)
        self.scores = torch.full((n,), NEG_INF, dtype=torch.float32, device=device)
        self.nodes = torch.zeros(n, dtype=torch.int64, device=device)  # trie node of each beam
        # the pool of finished beams, best first; score -inf: an empty slot
        self.f_tokens = self.tokens.clone()
        self.f_logprobs = self.token_logprobs.clone()
        self.f_lengths = torch.zeros(n, dtype=torch.int64, device=device)
        self.f_scores = self.scores.clone()
        self.f_reasons = torch.zeros(n, dtype=torch.int8, device=device)
        self.f_nodes = self.nodes.clone()
        self.num_steps = 0  # tokens chosen so far
        self.is_done = False

    @property
    def is_started(self) -> bool:
        return self.num_steps > 0

    def row_scores(self) -> torch.Tensor:
        """The score of each row this request feeds the next step: one prefill row, then n."""
        return self.scores if self.is_started else self.scores.new_zeros(1)

    def row_nodes(self) -> torch.Tensor:
        return self.nodes if self.is_started else self.nodes.new_zeros(1)

    def next_input(self) -> torch.Tensor:
        """The token each beam feeds next, [n] (a dead beam feeds a dummy 0)."""
        return self.tokens[:, self.num_steps - 1].clamp(min=0)

    def update(
        self,
        scores: torch.Tensor,
        step_logprobs: torch.Tensor,
        parents: torch.Tensor,
        tokens: torch.Tensor,
        nodes: torch.Tensor,
        reasons: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take this step's K candidates, best first ([K] each; reasons int8, 0 = runs on).

        Returns (parents [n] of the new running beams, the 'search is over' flag as a tensor)."""
        n, t = self.num_beams, self.num_steps
        finite = scores > NEG_INF
        ends = (reasons > 0) & finite
        runs = ~ends & finite
        rank = torch.arange(scores.numel(), device=scores.device)
        joins_pool = ends & (rank < n)
        runs = runs & (runs.cumsum(0) <= n)
        hist = self.tokens[parents]  # [K, T]
        hist[:, t] = tokens
        hist_lp = self.token_logprobs[parents]
        hist_lp[:, t] = step_logprobs
        # running beams: the first n candidates that do not end, in rank order
        run_scores, pick = torch.where(runs, scores, NEG_INF).topk(min(n, scores.numel()))
        if pick.numel() < n:  # fewer candidates than beams (a narrow first step): pad dead
            pad = n - pick.numel()
            pick = torch.cat((pick, pick.new_zeros(pad)))
            run_scores = torch.cat((run_scores, run_scores.new_full((pad,), NEG_INF)))
        self.tokens, self.token_logprobs = hist[pick], hist_lp[pick]
        self.scores, self.nodes = run_scores, nodes[pick]
        # the pool: the best n of what it held and the candidates that just ended
        merged = torch.cat((self.f_scores, torch.where(joins_pool, scores, NEG_INF)))
        self.f_scores, keep = merged.topk(n)
        self.f_tokens = torch.cat((self.f_tokens, hist))[keep]
        self.f_logprobs = torch.cat((self.f_logprobs, hist_lp))[keep]
        lengths = torch.full_like(tokens, t + 1)
        self.f_lengths = torch.cat((self.f_lengths, lengths))[keep]
        self.f_reasons = torch.cat((self.f_reasons, reasons.to(torch.int8)))[keep]
        self.f_nodes = torch.cat((self.f_nodes, nodes))[keep]
        self.num_steps = t + 1
        best_running = self.scores[0]
        pool_full = self.f_scores[-1] > NEG_INF
        over = (best_running == NEG_INF) | (pool_full & (best_running <= self.f_scores[-1]))
        if self.num_steps >= self.max_new_tokens:
            over = torch.ones_like(over)
        return parents[pick], over

    def results(self, aborted: bool = False) -> tuple[list[BeamResult], list[float], list[int]]:
        """The returned beams best first, the top one's per-token log-probabilities, and each
        beam's trie node (for the catalog's item lookup)."""
        if self.num_steps == 0:
            return [], [], []
        scores, tokens, lps = self.f_scores, self.f_tokens, self.f_logprobs
        lengths, reasons, nodes = self.f_lengths, self.f_reasons, self.f_nodes
        if aborted:  # the running beams too, as they stand
            running = self.scores > NEG_INF
            scores = torch.cat((scores, self.scores))
            tokens = torch.cat((tokens, self.tokens))
            lps = torch.cat((lps, self.token_logprobs))
            run_len = (self.tokens >= 0).sum(1)
            lengths = torch.cat((lengths, run_len))
            reasons = torch.cat((reasons, torch.where(running, -1, 0).to(torch.int8)))
            nodes = torch.cat((nodes, self.nodes))
            scores, keep = scores.topk(self.num_beams)
            tokens, lps, lengths = tokens[keep], lps[keep], lengths[keep]
            reasons, nodes = reasons[keep], nodes[keep]
        alive = (scores > NEG_INF).tolist()
        rows = zip(
            tokens.tolist(), lengths.tolist(), scores.tolist(), reasons.tolist(), alive, strict=True
        )
        beams = [
            BeamResult(toks[:length], score, REASONS.get(reason, "abort"))
            for toks, length, score, reason, ok in rows
            if ok
        ]
        top_lps = lps[0, : len(beams[0].output_ids)].tolist() if beams else []
        return beams, top_lps, nodes[: len(beams)].tolist()
