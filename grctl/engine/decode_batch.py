"""DecodeBatch: one decode step's attention layout across all running requests, built once a step.

Rows are the beams of every request in order ([rows, H, D] queries). Per layer, attention has
two parts, each sized by the work and never padded to the batch's worst request:
- context: each request's rows against its own context KV, read in place (a shared prefix once
  for every request of the step that continues it): engine/context_attention.py;
- tails: the rows whose beams have decoded the same number of tokens form a group, whose tails
  are one [layers, 2, group rows, KV, step + 1, D] tensor: a single request's own BeamKV, else
  gathered once a step (a few tokens per beam) and written back by `finish()`; each layer writes
  the fed token's k and v at `step` and attends over the group's tails at once;
then both parts merge by their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grctl.engine.context_attention import RaggedContext, Rows, put, row_set, take
from grctl.engine.kv_cache import BeamKV, ContextKV
from grctl.model import attention

if TYPE_CHECKING:
    from grctl.model.config import ModelConfig


@dataclass
class DecodeItem:
    """One request's share of a decode batch: feed `input_ids` [n] at beam KV slot `step`."""

    ctx: ContextKV
    beam_kv: BeamKV
    input_ids: torch.Tensor
    step: int


class TailGroup:
    """The rows of the requests whose beams feed output token `step` (every tail is step + 1
    long, this token included)."""

    def __init__(self, items: list[DecodeItem], bounds: list[tuple[int, int]], step: int, device):
        self.items, self.step = items, step
        self.rows, self.num_rows = row_set(bounds, device)
        if len(items) == 1:  # in place: the layers write straight into the request's BeamKV
            self.data = items[0].beam_kv.data[..., : step + 1, :]
            return
        first = items[0].beam_kv.data
        shape = (first.shape[0], 2, self.num_rows, first.shape[3], step + 1, first.shape[5])
        self.data = first.new_empty(shape)  # [layers, 2, rows, KV, step + 1, D]
        row = 0
        for it in items:
            n = it.beam_kv.num_beams
            if step:
                self.data[:, :, row : row + n, :, :step] = it.beam_kv.data[..., :step, :]
            row += n

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [rows, KV, g, D], k and v [rows, KV, D] of the whole step -> the group's out
        [group rows, KV, g, D] and lse [group rows, KV, g], float32."""
        self.data[layer, 0, :, :, self.step] = take(k, self.rows, 0)
        self.data[layer, 1, :, :, self.step] = take(v, self.rows, 0)
        q_group = take(q, self.rows, 0)
        return attention.tail_attention_with_lse(q_group, self.data[layer, 0], self.data[layer, 1])

    def finish(self) -> None:
        if len(self.items) == 1:
            return
        row = 0
        for it in self.items:
            n = it.beam_kv.num_beams
            it.beam_kv.data[..., : self.step + 1, :] = self.data[:, :, row : row + n]
            row += n


class DecodeBatch:
    def __init__(
        self, items: list[DecodeItem], cfg: ModelConfig, device: torch.device, context=RaggedContext
    ):
        """`context`: the context attention backend (engine/context_attention.py)."""
        self.items = items
        self.num_kv, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        self.groups = cfg.num_attention_heads // cfg.num_kv_heads
        bounds, row = [], 0
        for it in items:
            bounds.append((row, row + it.beam_kv.num_beams))
            row += it.beam_kv.num_beams
        self.num_rows = row
        self.context = context([it.ctx for it in items], bounds, device)
        by_step: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            by_step.setdefault(it.step, []).append(i)
        self.tails = [
            TailGroup([items[i] for i in idx], [bounds[i] for i in idx], step, device)
            for step, idx in sorted(by_step.items())
        ]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [rows, H, D], k and v [rows, KV, D] of the fed tokens -> [rows, H * D]."""
        rows = self.num_rows
        q_rows = q.view(rows, self.num_kv, self.groups, self.head_dim)
        o_ctx, lse_ctx = self.context.run(layer, q_rows.transpose(0, 1).contiguous())
        o_ctx, lse_ctx = o_ctx.transpose(0, 1), lse_ctx.transpose(0, 1)  # [rows, KV, g, (D)]
        if len(self.tails) == 1:
            out = attention.merge(o_ctx, lse_ctx, *self.tails[0].attend(layer, q_rows, k, v))[0]
        else:
            out = q.new_empty(q_rows.shape, dtype=torch.float32)
            for group in self.tails:
                o_t, lse_t = group.attend(layer, q_rows, k, v)
                parts = (take(o_ctx, group.rows, 0), take(lse_ctx, group.rows, 0), o_t, lse_t)
                put(out, group.rows, attention.merge(*parts)[0], 0)
        return out.to(q.dtype).reshape(rows, -1)

    def finish(self) -> None:
        """Each request's beams keep their tails, this step's token included."""
        for group in self.tails:
            group.finish()


__all__ = ["DecodeBatch", "DecodeItem", "Rows", "TailGroup"]
