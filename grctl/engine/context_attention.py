"""Context attention of a decode step: every query row against its request's context KV, read
where it lies.

A step's plan is built once from the requests' ContextKV chains: a `Unit` is one context part
(the KV of a request's own prompt tokens, or of a prefix that several requests continue) with
the query rows of every request of the step that reads it; units are grouped by their depth in
the chains (every context's oldest part is at depth 0). `run(layer, q)` gives each row's output
and the log-sum-exp of its scores over its whole context; decode_batch.py merges that with the
beams' tails.

`RaggedContext` is the backend on the CPU and on CUDA alike: one fused attention call per unit
on the part's own tensors, the unit's beams and GQA groups folded into the query rows
([1, KV, rows x g, D] against [1, KV, C, D]). No request is padded to another's length, no
context KV is copied, and a prefix that several requests of the step continue is read once for
all of their rows. A context's deeper parts merge into the rows by log-sum-exp.

The seam for FlashInfer's shared-prefix (cascade) batch decode is a second class with the same
two calls, set as `ModelRunner.context_attention`: the constructor takes the step's contexts and
rows (`plan`'s levels are cascade levels: the shared prefixes, then each request's own part) and
would run the wrapper's `plan`; `run` would call the wrapper's `run(q, kv, return_lse=True)` per
layer. Its kernels read KV from pages, so that backend needs the parts in a paged pool; it is
not built until a lent GPU can measure it against the ragged one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grctl.engine.kv_cache import ContextKV
from grctl.model import attention, batch_invariant

Rows = slice | torch.Tensor  # rows of the step, ascending: a range, or their indices


@dataclass
class Unit:
    part: ContextKV
    rows: Rows  # the query rows (beams) that read this part
    num_rows: int


def row_set(ranges: list[tuple[int, int]], device: torch.device) -> tuple[Rows, int]:
    """Ascending [start, end) row ranges -> a slice if they touch end to end, else indices."""
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    num = sum(end - start for start, end in merged)
    if len(merged) == 1:
        return slice(*merged[0]), num
    return torch.cat([torch.arange(s, e) for s, e in merged]).to(device), num


def take(x: torch.Tensor, rows: Rows, dim: int) -> torch.Tensor:
    if isinstance(rows, slice):
        return x[(slice(None),) * dim + (rows,)]
    return x.index_select(dim, rows)


def put(dst: torch.Tensor, rows: Rows, src: torch.Tensor, dim: int) -> None:
    if isinstance(rows, slice):
        dst[(slice(None),) * dim + (rows,)] = src
    else:
        dst.index_copy_(dim, rows, src.to(dst.dtype))


def plan(
    ctxs: list[ContextKV], bounds: list[tuple[int, int]], device: torch.device
) -> list[list[Unit]]:
    """Units by depth: each context's parts (empty ones skipped), a part shared by several
    contexts (the same tensors) once, with all of their rows. `bounds`: each context's rows,
    ascending."""
    levels: list[dict[tuple, tuple[ContextKV, list[tuple[int, int]]]]] = []
    for ctx, bound in zip(ctxs, bounds, strict=True):
        parts = [p for p in ctx.parts if p.own_length]
        assert parts, "a context holds at least one token"
        for depth, part in enumerate(parts):
            if depth == len(levels):
                levels.append({})
            levels[depth].setdefault(part.storage_key, (part, []))[1].append(bound)
    return [
        [Unit(part, *row_set(ranges, device)) for part, ranges in level.values()]
        for level in levels
    ]


class RaggedContext:
    def __init__(self, ctxs: list[ContextKV], bounds: list[tuple[int, int]], device: torch.device):
        self.levels = plan(ctxs, bounds, device)
        self.num_rows = bounds[-1][1]

    def run(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [KV, rows, g, D] -> out [KV, rows, g, D], lse [KV, rows, g], both float32."""
        out = lse = None
        for depth, units in enumerate(self.levels):
            for unit in units:
                o_u, lse_u = self._attend(layer, q, unit)
                if out is None and unit.num_rows == self.num_rows:  # one unit over every row
                    out, lse = o_u.float(), lse_u
                    continue
                if out is None:
                    out = q.new_empty(q.shape, dtype=torch.float32)
                    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
                if depth:
                    o_u, lse_u = attention.merge(
                        take(out, unit.rows, 1), take(lse, unit.rows, 1), o_u, lse_u
                    )
                put(out, unit.rows, o_u, 1)
                put(lse, unit.rows, lse_u, 1)
        return out, lse

    @staticmethod
    def _attend(layer: int, q: torch.Tensor, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        num_kv, _, groups, dim = q.shape
        q_unit = take(q, unit.rows, 1).reshape(1, num_kv, unit.num_rows * groups, dim)
        k, v = unit.part.k[layer].unsqueeze(0), unit.part.v[layer].unsqueeze(0)
        out, lse = attention.attention_with_lse(q_unit, k, v)
        shape = (num_kv, unit.num_rows, groups)
        return out.reshape(*shape, dim), lse.reshape(shape)


class InvariantContext(RaggedContext):
    """The deterministic backend (--enable-deterministic-inference): each unit's rows through
    batch-invariant attention (model/batch_invariant.py), so a row's output is the same
    whatever else the step holds. The executor gives every context one part (a cached prefix
    joined to the prompt's own KV at prefill), so a prefix-cache hit attends as a miss does."""

    @staticmethod
    def _attend(layer: int, q: torch.Tensor, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        num_kv, _, groups, dim = q.shape
        rows = take(q, unit.rows, 1)  # [KV, rows, g, D] -> [rows, H, D]
        q_rows = rows.permute(1, 0, 2, 3).reshape(unit.num_rows, num_kv * groups, dim)
        out, lse = batch_invariant.attention(q_rows, unit.part.k[layer], unit.part.v[layer])
        out = out.view(unit.num_rows, num_kv, groups, dim).permute(1, 0, 2, 3)
        return out, lse.view(unit.num_rows, num_kv, groups).permute(1, 0, 2)
