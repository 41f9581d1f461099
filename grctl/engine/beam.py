"""Beams: the output side of one request, on the device.

n > 1 is beam search scored by cumulative log-probability: the first n tokens are the top n of the
prefill's distribution; then each step keeps the best n among the expansions of unfinished beams
and the finished beams themselves (a beam that hit a stop token is finished and stops growing).
n == 1 is the same bookkeeping with one row and a Sampler choosing the token (greedy or sampled).
Beams stay sorted best first, and `advance` returns each new beam's parent so the caller can
reorder the per-beam KV.
"""

from __future__ import annotations

import torch

from grctl.engine.request import BeamResult
from grctl.engine.sampler import Sampler


class Beams:
    def __init__(
        self,
        num_beams: int,
        max_new_tokens: int,
        stop_ids: tuple[int, ...],
        device: torch.device,
        sampler: Sampler | None = None,
    ):
        self.num_beams = num_beams
        self.max_new_tokens = max_new_tokens
        self.sampler = sampler  # n == 1 only
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.int64, device=device)
        shape = (num_beams, max_new_tokens)
        self.tokens = torch.full(shape, -1, dtype=torch.int64, device=device)  # -1: none
        self.token_logprobs = torch.zeros(shape, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(num_beams, dtype=torch.int64, device=device)
        self.scores = torch.zeros(num_beams, dtype=torch.float32, device=device)
        self.finished = torch.zeros(num_beams, dtype=torch.bool, device=device)
        self.num_steps = 0  # output tokens chosen so far (the longest beam's length)
        self.all_finished = False

    @property
    def is_done(self) -> bool:
        return self.num_steps >= self.max_new_tokens or self.all_finished

    def _is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.isin(tokens, self.stop_ids) & (tokens >= 0)

    def start(self, logprobs: torch.Tensor) -> None:
        """The first token(s) from the prefill's log-probabilities [vocab]."""
        if self.sampler is not None:
            tokens = self.sampler.choose(logprobs)
            scores = logprobs[tokens]
        else:
            scores, tokens = logprobs.topk(self.num_beams)
        self.tokens[:, 0] = tokens
        self.token_logprobs[:, 0] = scores
        self.scores.copy_(scores)
        self.lengths.fill_(1)
        self.finished = self._is_stop(tokens)
        self.num_steps = 1
        self.all_finished = bool(self.finished.all())

    def next_input(self) -> torch.Tensor:
        """The token each beam feeds next, [n] (a finished beam feeds a dummy 0)."""
        return self.tokens[:, self.num_steps - 1].clamp(min=0)

    def advance(self, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs [n, vocab] of each beam's next token -> parents [n] of the new beams."""
        n, vocab = logprobs.shape
        t = self.num_steps
        if self.sampler is not None:  # one unfinished row: its chosen token, nothing carried
            idx = self.sampler.choose(logprobs[0])
            top = self.scores + logprobs[0, idx]
        else:
            cand = (self.scores[:, None] + logprobs).masked_fill(self.finished[:, None], -torch.inf)
            carried = self.scores.masked_fill(~self.finished, -torch.inf)
            top, idx = torch.cat((cand.flatten(), carried)).topk(n)
        is_new = idx < n * vocab
        parents = torch.where(is_new, idx // vocab, idx - n * vocab)
        new_tokens = torch.where(is_new, idx % vocab, -1)
        self.tokens = self.tokens[parents]
        self.tokens[:, t] = new_tokens
        self.token_logprobs = self.token_logprobs[parents]
        step_lp = logprobs[parents, new_tokens.clamp(min=0)]
        self.token_logprobs[:, t] = torch.where(is_new, step_lp, 0.0)
        self.lengths = torch.where(is_new, t + 1, self.lengths[parents])
        self.finished = self.finished[parents] | self._is_stop(new_tokens)
        self.scores = top
        self.num_steps = t + 1
        self.all_finished = bool(self.finished.all())
        return parents

    def results(self, aborted: bool = False) -> tuple[list[BeamResult], list[float]]:
        """Every beam, best first, and the top beam's per-token log-probabilities."""
        if self.num_steps == 0:
            return [], []
        tokens, lengths = self.tokens.tolist(), self.lengths.tolist()
        scores, finished = self.scores.tolist(), self.finished.tolist()
        beams = []
        for toks, length, score, done in zip(tokens, lengths, scores, finished, strict=True):
            reason = "stop" if done else ("abort" if aborted else "length")
            beams.append(BeamResult(toks[:length], score, reason))
        return beams, self.token_logprobs[0, : lengths[0]].tolist()
