"""DecodeBatch: one decode step's attention layout across all running requests, built once a step.

Rows are the beams of every request in order ([rows, H, D] queries). Per layer, attention is a
fixed number of calls whatever the number of requests:
- context: the requests' contexts as one batch [R, KV, C_max, D] (a single request's context is
  used in place; several are padded into one buffer, pads masked by a -inf key bias); each
  request's beams x GQA groups are its query rows, scattered by one index into [R, KV, Q_max, D];
- tails: every beam's decoded-token KV, gathered for the step into [layers, 2, rows, KV, T, D]
  (T = the longest tail), where each layer writes its new k and v for all rows at once;
then both parts merge by their log-sum-exp. `finish()` writes the tails back to each request's
BeamKV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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


class DecodeBatch:
    def __init__(self, items: list[DecodeItem], cfg: ModelConfig, device: torch.device):
        self.items = items
        num_kv, dim = cfg.num_kv_heads, cfg.head_dim
        groups = cfg.num_attention_heads // num_kv
        self.num_kv, self.groups, self.head_dim = num_kv, groups, dim
        beams = [it.beam_kv.num_beams for it in items]
        steps = [it.step for it in items]
        self.num_rows = rows = sum(beams)
        self.q_rows = max(beams) * groups  # query rows per (request, kv head)
        counts = torch.tensor(beams)
        item = torch.repeat_interleave(torch.arange(len(items)), counts)  # [rows]
        local = torch.arange(rows) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        # [rows, KV, g] -> position in [R, KV, Q_max]: request, kv head, then beam-major groups
        index = (item[:, None, None] * num_kv + torch.arange(num_kv)[None, :, None]) * self.q_rows
        index = index + local[:, None, None] * groups + torch.arange(groups)[None, None, :]
        self.q_index = index.flatten().to(device)
        row_steps = torch.repeat_interleave(torch.tensor(steps), counts)
        width = max(steps) + 1
        self.valid = (torch.arange(width)[None, :] <= row_steps[:, None]).to(device)
        self.rows = torch.arange(rows, device=device)
        self.row_steps = row_steps.to(device)
        first = items[0].beam_kv.data
        shape = (first.shape[0], 2, rows, num_kv, width, dim)
        self.tails = torch.zeros(shape, dtype=first.dtype, device=device)
        self.bounds = []
        row = 0
        for it, n in zip(items, beams, strict=True):
            if it.step:
                self.tails[:, :, row : row + n, :, : it.step] = it.beam_kv.data[..., : it.step, :]
            self.bounds.append((row, row + n))
            row += n
        self.key_bias = None
        if len(items) > 1:
            lengths = torch.tensor([it.ctx.length for it in items])
            pads = torch.arange(int(lengths.max()))[None, :] >= lengths[:, None]  # [R, C_max]
            bias = torch.zeros(pads.shape, dtype=first.dtype).masked_fill(pads, float("-inf"))
            self.key_bias = bias[:, None, None, :].to(device)

    def _context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of every request's context in this layer: [R, KV, C_max, D]."""
        if len(self.items) == 1:
            ctx = self.items[0].ctx
            return ctx.k[layer].unsqueeze(0), ctx.v[layer].unsqueeze(0)
        shape = (len(self.items), self.num_kv, self.key_bias.shape[-1], self.head_dim)
        out = []
        for part in ("k", "v"):
            padded = self.tails.new_zeros(shape)
            for r, it in enumerate(self.items):
                src = getattr(it.ctx, part)[layer]
                padded[r, :, : src.shape[1]] = src
            out.append(padded)
        return out[0], out[1]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [rows, H, D], k and v [rows, KV, D] of the fed tokens -> [rows, H * D]."""
        rows, dim = self.num_rows, self.head_dim
        self.tails[layer, 0, self.rows, :, self.row_steps] = k
        self.tails[layer, 1, self.rows, :, self.row_steps] = v
        shape = (len(self.items), self.num_kv, self.q_rows, dim)
        q_pad = q.new_zeros(shape).view(-1, dim).index_copy_(0, self.q_index, q.reshape(-1, dim))
        ctx_k, ctx_v = self._context(layer)
        o_ctx, lse_ctx = attention.attention_with_lse(
            q_pad.view(shape), ctx_k, ctx_v, self.key_bias
        )
        o_ctx = o_ctx.reshape(-1, dim).index_select(0, self.q_index)
        lse_ctx = lse_ctx.reshape(-1).index_select(0, self.q_index)
        q_rows = q.view(rows, self.num_kv, self.groups, dim)
        o_tail, lse_tail = attention.tail_attention_with_lse(
            q_rows, self.tails[layer, 0], self.tails[layer, 1], self.valid
        )
        out = attention.merge(o_ctx.view_as(o_tail), lse_ctx.view_as(lse_tail), o_tail, lse_tail)
        return out.to(q.dtype).reshape(rows, -1)

    def finish(self) -> None:
        """Each request's beams keep their tails, this step's token included."""
        for it, (start, end) in zip(self.items, self.bounds, strict=True):
            length = it.step + 1
            it.beam_kv.data[..., :length, :] = self.tails[:, :, start:end, :, :length]
