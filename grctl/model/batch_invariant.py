"""Batch-invariant kernels: each row's result depends on that row's inputs alone, never on how
many other rows share the call, where the row sits in it, or how a context is split in memory.

What varies otherwise: a GEMM's kernel and blocking follow its row count M (one row takes a
GEMV, a few rows another micro-kernel), so the same token's projection differs in its last bits
alone and in a batch; a reduction's split follows its shape; attention's order follows how its
queries and keys are cut (a prefix-cache hit attends in two parts, a miss in one). Here:

- `linear`: the rows are cut into tiles of ROW_TILE rows (the last one zero-padded) and every
  tile runs the same [ROW_TILE, K] x [K, N] product, as one batched matmul: one shape, one
  kernel, one reduction order over K for every row.
- `rms_norm`: the mean of squares as the same tiled product against columns of ones.
- `attention`: every query row against keys cut at fixed absolute positions (blocks of
  KEY_BLOCK keys, the last padded and masked), each block's scores and weighted values as fixed-
  shape products, the blocks merged one after another in position order (online softmax, a
  fully masked block leaves the running sums exactly as they were). A row's output is a function
  of its query, its position and the keys before it, whatever else the call holds.

Written for CUDA too (the same shapes give cuBLAS the same kernel), where it is untested.
"""

from __future__ import annotations

import torch

ROW_TILE = 32  # rows of every matmul tile
KEY_BLOCK = 64  # keys of every attention block
CHUNK_BYTES = 64 << 20  # attention's temporaries per chunk of query tiles


def _tiles(x: torch.Tensor, tile: int = ROW_TILE) -> tuple[torch.Tensor, int]:
    """x [rows, K] -> [tiles, tile, K] (zero rows appended), and the row count."""
    rows = x.shape[0]
    pad = -rows % tile
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    return x.view(-1, tile, x.shape[1]), rows


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias), row-invariant: x [..., K], weight [N, K] -> [..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    tiles, rows = _tiles(x.reshape(-1, k))
    out = torch.bmm(tiles, weight.t().expand(tiles.shape[0], k, weight.shape[0]))
    return out.reshape(-1, weight.shape[0])[:rows].reshape(*lead, weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """grctl's RMSNorm (the mean in float32, the product in x's dtype), row-invariant."""
    dtype, xf = x.dtype, x.float()
    # a product of one column takes a GEMV whose result follows the row's place: 16 columns
    ones = xf.new_ones(16, xf.shape[-1])
    mean = linear(xf * xf, ones)[..., :1] / xf.shape[-1]  # [..., 1]
    return weight * (xf * torch.rsqrt(mean + eps)).to(dtype)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]; k, v [KV, S, D] (keys at positions 0 .. S - 1); q_pos [n] each query's
    position (it sees keys 0 .. q_pos), None: every key. -> out [n, H, D] and lse [n, H], both
    float32 (the log-sum-exp of the scaled scores, for a merge with other keys)."""
    n, heads, dim = q.shape
    num_kv, length = k.shape[0], k.shape[1]
    groups = heads // num_kv
    blocks = -(-length // KEY_BLOCK)
    pad = blocks * KEY_BLOCK - length
    kf, vf = k.float(), v.float()
    if pad:
        kf = torch.cat((kf, kf.new_zeros(num_kv, pad, dim)), dim=1)
        vf = torch.cat((vf, vf.new_zeros(num_kv, pad, dim)), dim=1)
    # values with a ones column: one product gives the weighted sum and the weights' sum
    vf = torch.cat((vf, vf.new_ones(num_kv, blocks * KEY_BLOCK, 1)), dim=-1)
    kb = kf.view(num_kv, blocks, KEY_BLOCK, dim).transpose(-1, -2)  # [KV, B, D, KB]
    vb = vf.view(num_kv, blocks, KEY_BLOCK, dim + 1)  # [KV, B, KB, D + 1]
    # query rows per kv head: (query, group) pairs, in tiles
    qr = q.float().view(n, num_kv, groups, dim).permute(1, 0, 2, 3).reshape(num_kv, n * groups, dim)
    qpad = -(n * groups) % ROW_TILE
    if qpad:
        qr = torch.cat((qr, qr.new_zeros(num_kv, qpad, dim)), dim=1)
    tiles = qr.shape[1] // ROW_TILE
    qt = qr.view(num_kv, tiles, 1, ROW_TILE, dim) * dim**-0.5
    key_pos = torch.arange(blocks * KEY_BLOCK, device=q.device).view(blocks, KEY_BLOCK)
    limit = torch.full((n,), length - 1, device=q.device) if q_pos is None else q_pos
    limit = torch.minimum(limit.to(q.device), torch.tensor(length - 1, device=q.device))
    row_limit = limit.repeat_interleave(groups)
    if qpad:
        # padding rows see key 0 (a 0 / 0 there would turn a backward pass into NaN)
        row_limit = torch.cat((row_limit, row_limit.new_zeros(qpad)))
    row_limit = row_limit.view(tiles, ROW_TILE)
    # query tiles a chunk at a time: the [tiles, blocks] scores are never all held at once
    per_tile = num_kv * blocks * ROW_TILE * (2 * dim + 2 * KEY_BLOCK + 4) * 4
    step = max(1, CHUNK_BYTES // per_tile)
    runs, peaks = [], []
    for lo in range(0, tiles, step):
        r, m = _tile_attention(qt[:, lo : lo + step], kb, vb, key_pos, row_limit[lo : lo + step])
        runs.append(r)
        peaks.append(m)
    run, run_m = torch.cat(runs, dim=1), torch.cat(peaks, dim=1)
    out = run[..., :dim] / run[..., dim:]
    lse = run_m + run[..., dim:].log()
    out = out.reshape(num_kv, tiles * ROW_TILE, dim)[:, : n * groups]
    lse = lse.reshape(num_kv, tiles * ROW_TILE)[:, : n * groups]
    out = out.view(num_kv, n, groups, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
    return out, lse.view(num_kv, n, groups).permute(1, 0, 2).reshape(n, heads)


def _tile_attention(qt, kb, vb, key_pos, row_limit):
    """qt [KV, T, 1, RT, D] scaled queries, kb [KV, B, D, KB], vb [KV, B, KB, D + 1],
    row_limit [T, RT] -> the merged (weighted sum | weights' sum) [KV, T, RT, D + 1] and the
    running max [KV, T, RT, 1]."""
    num_kv, tiles, _, rt, dim = qt.shape
    blocks, kbl = kb.shape[1], kb.shape[3]
    batch = num_kv * tiles * blocks
    qe = qt.expand(num_kv, tiles, blocks, rt, dim).reshape(batch, rt, dim)
    ke = kb[:, None].expand(num_kv, tiles, blocks, dim, kbl).reshape(batch, dim, kbl)
    scores = torch.bmm(qe, ke).view(num_kv, tiles, blocks, rt, kbl)
    visible = key_pos[None, :, None, :] <= row_limit[:, None, :, None]  # [T, B, RT, KB]
    scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(-1, keepdim=True)
    peak = peak.masked_fill(~torch.isfinite(peak), 0.0)
    weights = (scores - peak).exp()
    ve = vb[:, None].expand(num_kv, tiles, blocks, kbl, dim + 1).reshape(batch, kbl, dim + 1)
    acc = torch.bmm(weights.view(batch, rt, kbl), ve).view(num_kv, tiles, blocks, rt, dim + 1)
    peak = peak.masked_fill(~visible.any(-1, keepdim=True), float("-inf"))
    run_m = torch.full_like(peak[:, :, 0], float("-inf"))  # [KV, T, RT, 1]
    run = torch.zeros_like(acc[:, :, 0])
    for b in range(blocks):  # in position order, whatever the call holds
        m_b = peak[:, :, b]
        new_m = torch.maximum(run_m, m_b)
        safe = new_m.masked_fill(~torch.isfinite(new_m), 0.0)
        run = run * (run_m - safe).exp() + acc[:, :, b] * (m_b - safe).exp()
        run_m = new_m
    return run, run_m
