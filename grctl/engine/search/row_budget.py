"""How many of its best tokens a deterministic row must rank so that its request's K best
candidates are all among them: at wide beams far fewer than K.

A request of W beams ranks K >= W candidates a step. Each row's top K by score is enough (one
row could hold all K winners), but at W = 1,024 that is a top-1,024 of every row's vocabulary:
most of a step's selection time, nearly all of it for nothing. Instead each row ranks only its
best `per` tokens (per = ceil(K / rows), at least PER_ROW), and those rows x per candidates bound
the request's K-th best score from below; a row's tokens below that bound cannot be among the K
best. A row whose per-th best is still above the bound (its parent far ahead of the others) may
hold more: those rows alone rank as many as they hold (at most K). The K best are the same
candidates as with K per row (the bound is lowered by a margin for the rounding of the score's
sum, which only ranks more). Rows that end early, catalogs and sampled rows are not changed.
"""

from __future__ import annotations

import numpy as np
import torch

from grctl.engine.search.segments import segment_topk

NEG_INF = float("-inf")
PRUNE_FROM = 64  # below this K the bound's passes cost more than the top-K they spare
MARGIN = 1e-5  # relative, for the score's float32 rounding
PER_ROW = 8  # the fewest best tokens per row that make the bound


def row_top(
    xr: torch.Tensor, row_lse, p_score: torch.Tensor, num_rows: list[int], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """xr [rows, m] logits (or log-probabilities, row_lse 0.0), row_lse [rows, 1] or 0.0,
    p_score [rows] the parent beams' scores (score = p_score + xr - row_lse), num_rows each
    request's rows in order, k candidates per request -> (values, columns) [rows, kk] of each
    row's tokens that may be among its request's k best, best first, kk <= k; a row with fewer
    has -inf (column 0) past them."""
    rows, m = xr.shape
    per = max(max(-(-k // max(n, 1)) for n in num_rows), PER_ROW)
    if k < PRUNE_FROM or per >= min(k, m):
        return xr.topk(k, dim=-1)
    lse = row_lse[:, 0] if torch.is_tensor(row_lse) else torch.zeros_like(p_score)
    lp, col = xr.topk(per, dim=-1)  # the one pass over every row's vocabulary
    score = p_score[:, None] + (lp - lse[:, None])
    lengths = np.array(num_rows) * per
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    bound = segment_topk(score.flatten(), starts, lengths, k)[0][:, -1]  # [requests]
    if not bool(torch.isfinite(bound).all()):  # too few finite candidates: rank them all
        return xr.topk(k, dim=-1)
    reps = torch.from_numpy(np.array(num_rows, dtype=np.int64)).to(xr.device)
    bound = bound.repeat_interleave(reps)  # [rows]
    # score >= bound  <=>  xr >= bound - p_score + lse, less a margin for rounding (a dead
    # row, p_score -inf, gives +inf: nothing)
    thr = bound - p_score + lse
    thr = thr - MARGIN * (bound.abs() + p_score.abs() + lse.abs() + 1)
    kept = lp >= thr[:, None]  # a prefix of each row's sorted best
    full = kept[:, -1].nonzero().flatten()  # rows that may hold more than `per`
    width = int(kept.sum(-1).max())
    extra = None
    if full.numel():
        sub = xr.index_select(0, full)
        held = int((sub >= thr.index_select(0, full)[:, None]).sum(-1).max())
        if held >= k:
            return xr.topk(k, dim=-1)  # one row holds them all
        extra = sub.topk(held, dim=-1)
        width = held
    width = max(width, 1)
    values = lp[:, :width].masked_fill(~kept[:, :width], NEG_INF)
    cols = col[:, :width].masked_fill(~kept[:, :width], 0)
    if width > per:
        values = torch.nn.functional.pad(values, (0, width - per), value=NEG_INF)
        cols = torch.nn.functional.pad(cols, (0, width - per))
    if extra is not None:
        ev, ec = extra
        ok = ev >= thr.index_select(0, full)[:, None]
        values[full] = ev.masked_fill(~ok, NEG_INF)
        cols[full] = ec.masked_fill(~ok, 0)
    return values, cols
