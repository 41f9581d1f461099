"""KV storage for the GR workload: one shared context per request, a short private tail per beam.

A request's prompt is prefilled once; its KV (`ContextKV`) is read by every beam and never
written again, so it is also what the prefill cache keeps; a context may continue another
(a shared prefix), read in place. Each beam owns only the KV of the
tokens it decoded (`BeamKV`), a few steps long; reordering beams gathers that small tail only.
Also: the KV bytes a request holds and the budget admission holds them to (--max-kv-bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grctl.engine.config import EngineConfig


@dataclass(frozen=True, eq=False)
class ContextKV:
    """A request's context KV, read-only: per layer k and v of its own tokens, each
    [num_kv_heads, tokens, head_dim], which follow `prefix`'s tokens (None: these are all of
    them). A prefix is itself a ContextKV, held by reference and possibly read by other requests'
    contexts at the same time; decode attention reads every part where it lies and merges the
    parts by log-sum-exp, so nothing is ever joined or copied (engine/context_attention.py)."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    prefix: ContextKV | None = None

    @property
    def parts(self) -> list[ContextKV]:
        """The chain, oldest part first (this one last)."""
        chain = [] if self.prefix is None else self.prefix.parts
        return [*chain, self]

    @property
    def own_length(self) -> int:
        return self.k[0].shape[1]

    @property
    def length(self) -> int:
        """Tokens in the whole context, prefix included (the next token's position)."""
        return self.own_length + (0 if self.prefix is None else self.prefix.length)

    @property
    def own_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole context, prefix included (what a request reads)."""
        return self.own_nbytes + (0 if self.prefix is None else self.prefix.nbytes)

    @property
    def storage_key(self) -> tuple:
        """Equal for two ContextKV over the same tensors (the same tokens' KV): the prefix
        cache wraps its nodes' KV anew for each request that continues them."""
        k, v = self.k[0], self.v[0]
        return k.data_ptr(), v.data_ptr(), tuple(k.shape), k.stride()


def chained(parts: list[ContextKV]) -> ContextKV | None:
    """Consecutive parts (each one's own tokens) as one chain, the last part last; nothing is
    copied. None for no parts."""
    ctx = None
    for part in parts:
        ctx = part if ctx is None and part.prefix is None else ContextKV(part.k, part.v, ctx)
    return ctx


# fp32 [rows, vocab] tensors a step holds per beam row: the logits, their log-softmax, a
# stochastic draw's noise and the masked scores the selection ranks.
LOGITS_COPIES = 4


def request_kv_bytes(cfg, itemsize: int, prompt_len: int, num_beams: int, max_new: int) -> int:
    """The memory a request holds while it runs (cfg: ModelConfig): its context and its beams'
    tails, plus the fp32 logits rows of its beams in a step, which grow with the vocabulary
    rather than the context."""
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    kv = per_token * (prompt_len + num_beams * max(max_new - 1, 1))
    return kv + LOGITS_COPIES * num_beams * cfg.vocab_size * 4


TOP_PAIR_BYTES = 4 + 8  # an fp32 log-probability and its int64 token id


def top_logprobs_bytes(num_beams: int, max_new: int, k: int) -> int:
    """What a request asking for k top log-probabilities keeps while it runs: each step's
    [beams, k] rows (StepState.rows_top, kept for the request's whole history)."""
    return TOP_PAIR_BYTES * num_beams * k * max_new


def sampling_mask_bytes(num_beams: int, max_new: int, vocab: int, cap: int) -> int:
    """What a request asking for its sampling support keeps while it runs: each step's
    [beams, min(vocab, cap + 1)] rows of it (Beams.mask_history; cap: --sampling-mask-max-tokens,
    the one more column tells a support over the cap)."""
    return TOP_PAIR_BYTES * num_beams * min(vocab, cap + 1) * max_new


def kv_bytes_budget(config: EngineConfig, device: torch.device) -> int | None:
    """--max-kv-bytes, else a share of the GPU memory free now (the weights are loaded); None
    (no limit) on the CPU."""
    if config.max_kv_bytes:
        return config.max_kv_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.kv_memory_fraction)
    return None


class BeamKV:
    """KV of decoded tokens for `num_beams` beams: [layers, 2, beams, kv_heads, steps, head_dim].

    Step s holds the KV of output token s (the token fed at decode step s). The last output
    token is never fed, so `max_steps` is max_new_tokens - 1.
    """

    def __init__(
        self,
        num_layers: int,
        num_beams: int,
        num_kv_heads: int,
        max_steps: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, 2, num_beams, num_kv_heads, max(max_steps, 1), head_dim)
        self.data = torch.empty(shape, dtype=dtype, device=device)

    @property
    def num_beams(self) -> int:
        return self.data.shape[2]

    def write(self, layer: int, step: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [beams, kv_heads, head_dim] of the token fed at `step`."""
        self.data[layer, 0, :, :, step] = k
        self.data[layer, 1, :, :, step] = v

    def keys(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of the first `length` steps: [beams, kv_heads, length, head_dim] (views)."""
        return self.data[layer, 0, :, :, :length], self.data[layer, 1, :, :, :length]

    def reorder(self, parents: torch.Tensor, length: int) -> None:
        """Beam i takes the first `length` steps of beam parents[i]: the small tail only."""
        if length == 0:
            return
        tail = self.data[:, :, :, :, :length]
        tail.copy_(tail.index_select(2, parents))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
