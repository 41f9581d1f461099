"""Choosing the next token of an n == 1 request: greedy, or sampled with temperature, top-k and
top-p from a per-request generator (seeded => the same tokens for the same log-probabilities)."""

from __future__ import annotations

import secrets

import torch

from grctl.engine.search.params import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.temperature = params.temperature
        self.top_p = params.top_p
        self.top_k = params.top_k
        self.generator: torch.Generator | None = None
        if self.temperature > 0:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed & (2**64 - 1))

    def choose(self, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs [vocab] float32 (-inf: not allowed) -> the chosen token id, [1] int64."""
        if self.generator is None:
            return logprobs.argmax().view(1)
        logits = logprobs / self.temperature
        if 0 < self.top_k < logits.numel():
            kth = torch.topk(logits, self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the tokens ranked above it already reach top_p (keeps the first)
            drop = probs.cumsum(-1) - probs >= self.top_p
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(-1)
        # every token -inf (a catalog path whose children are all suppressed): any token, and
        # its -inf score ends the sequence
        probs = torch.nan_to_num(probs, nan=1.0)
        return torch.multinomial(probs, 1, generator=self.generator)
