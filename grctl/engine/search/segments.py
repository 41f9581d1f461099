"""Segmented top-k: the k largest of each request's slice of one flat tensor, for all requests
in a few ops. Segments are padded to a power of two and grouped by that length, so a batch of
equal requests is one gather and one topk, and one wide request among many narrow ones pads
only its own group."""

from __future__ import annotations

import numpy as np
import torch

NEG_INF = float("-inf")


def segment_topk(
    values: torch.Tensor, starts: np.ndarray, lengths: np.ndarray, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """values [n] flat; segment s is values[starts[s] : starts[s] + lengths[s]] (host arrays).
    Returns the k largest of each segment, best first, [S, k], and their positions in values
    [S, k]; past a segment's end: -inf at position n."""
    dev = values.device
    num, n = len(starts), values.numel()
    padded = torch.cat((values, values.new_full((1,), NEG_INF)))
    top = values.new_full((num, k), NEG_INF)
    pos = torch.full((num, k), n, dtype=torch.int64, device=dev)
    widths = 1 << np.ceil(np.log2(np.maximum(np.maximum(lengths, k), 1))).astype(np.int64)
    for width in sorted(set(widths.tolist())):
        sel = np.flatnonzero(widths == width)
        rows = torch.from_numpy(sel).to(dev)
        seg = torch.from_numpy(np.stack((starts[sel], lengths[sel]), 1)).to(dev)  # [s, 2]
        cols = torch.arange(int(width), device=dev)
        idx = (seg[:, :1] + cols[None]).masked_fill(cols[None] >= seg[:, 1:], n)
        v, p = padded[idx].topk(k, dim=-1)
        top[rows] = v
        pos[rows] = idx.gather(1, p)
    return top, pos
