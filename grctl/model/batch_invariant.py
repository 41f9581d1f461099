"""Batch-invariant kernels: each row's result depends on that row's inputs alone, never on how
many other rows share the call, where the row sits in it, or how a context is split in memory.

What varies otherwise: a GEMM's kernel and blocking follow its row count M (one row takes a
GEMV, a few rows another micro-kernel), so the same token's projection differs in its last bits
alone and in a batch; a reduction's split follows its shape; attention's order follows how its
queries and keys are cut (a prefix-cache hit attends in two parts, a miss in one). Here:

- `linear`: the rows are cut into tiles of ROW_TILE rows (the last one zero-padded) and every
  tile runs the same [ROW_TILE, K] x [K, N] product, as batched matmuls: one shape, one
  kernel, one reduction order over K for every row.
- `rms_norm`: the mean of squares as the same tiled product against columns of ones.
- `attention`: query rows in fixed tiles against keys cut at fixed absolute positions. On the
  CPU, torch's flash kernel per tile (its kv blocks start at key 0; a causal call pads the keys
  to whole 512-key blocks, so the blocks do not follow the key count); elsewhere blocks of
  KEY_BLOCK keys, each block's scores and weighted values as fixed-shape products, merged one
  after another in position order (online softmax: a fully masked block leaves the running sums
  exactly as they were). A row's output is a function of its query, its position and the keys
  before it (a decode row: of the whole context), whatever else the call holds.

Written for CUDA too (the same shapes give cuBLAS the same kernel), where it is untested.
"""

from __future__ import annotations

import torch

ROW_TILE = 32  # rows of every matmul tile
KEY_BLOCK = 64  # keys of every attention block
CHUNK_BYTES = 64 << 20  # attention's temporaries per chunk of query tiles
FLASH_KV_BLOCK = 512  # torch's CPU flash attention cuts keys in blocks of min(512, keys)
PREFILL_TILE = 256  # query rows of a causal (prefill) attention tile on the CPU


def _tiles(x: torch.Tensor, tile: int = ROW_TILE) -> tuple[torch.Tensor, int]:
    """x [rows, K] -> [tiles, tile, K] (zero rows appended), and the row count."""
    rows = x.shape[0]
    pad = -rows % tile
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    return x.view(-1, tile, x.shape[1]), rows


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias), row-invariant: x [..., K], weight [N, K] -> [..., N].
    The whole tiles are read in place; only the last, partial one is copied and padded."""
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    whole = rows - rows % ROW_TILE
    w, outs = weight.t(), []
    if whole:
        main = flat[:whole].view(-1, ROW_TILE, k)
        outs.append(torch.bmm(main, w.expand(main.shape[0], k, n)).view(-1, n))
    if whole < rows:
        tail, _ = _tiles(flat[whole:])
        outs.append(torch.bmm(tail, w.expand(1, k, n)).view(-1, n)[: rows - whole])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*lead, n)


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
    if q.device.type == "cpu":
        return _flash_tiles(q, k, v, q_pos)
    return block_attention(q, k, v, q_pos)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention` off the CPU (any device runs it): KEY_BLOCK-key blocks merged in order."""
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


def _flash_tiles(q, k, v, q_pos):
    """The CPU path: torch's fused flash attention over query tiles of ROW_TILE rows. Its kv
    blocks start at key 0 and their size follows the key count alone, its query block is the
    tile, so every row meets the same products and the same reduction order."""
    n, heads, dim = q.shape
    num_kv, length = k.shape[0], k.shape[1]
    groups = heads // num_kv
    rows = n * groups
    # a prefill's many rows in long tiles (the kernel cuts each in query blocks of 64), a
    # decode step's few in short ones (one query block of 32)
    tile = PREFILL_TILE if q_pos is not None else ROW_TILE
    qr = q.view(n, num_kv, groups, dim).permute(1, 0, 2, 3).reshape(num_kv, rows, dim)
    pad = -rows % tile
    if pad:
        qr = torch.cat((qr, qr.new_zeros(num_kv, pad, dim)), dim=1)
    tiles = qr.shape[1] // tile
    qt = qr.view(num_kv, tiles, tile, dim).transpose(0, 1)  # [T, KV, tile, D]
    mask = None
    if q_pos is not None:
        # causal rows: keys padded to whole kv blocks of torch's kernel, so that its blocks
        # (their size is min(512, keys)) do not follow the key count: a prompt's rows then
        # give the same bits whether later tokens (a longer prompt sharing the prefix) follow
        kpad = -length % FLASH_KV_BLOCK
        if kpad:
            k = torch.cat((k, k.new_zeros(num_kv, kpad, dim)), dim=1)
            v = torch.cat((v, v.new_zeros(num_kv, kpad, dim)), dim=1)
        limit = q_pos.to(q.device).repeat_interleave(groups)
        if pad:  # padding rows see every key (nothing of theirs is kept)
            limit = torch.cat((limit, limit.new_full((pad,), length - 1)))
        visible = torch.arange(k.shape[1], device=q.device)[None, :] <= limit[:, None]
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill(~visible, float("-inf")).view(tiles, 1, tile, k.shape[1])
    kt = k.unsqueeze(0).expand(tiles, *k.shape)
    vt = v.unsqueeze(0).expand(tiles, *v.shape)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qt, kt, vt, attn_mask=mask
    )
    out = out.float().transpose(0, 1).reshape(num_kv, tiles * tile, dim)[:, :rows]
    lse = lse.float().transpose(0, 1).reshape(num_kv, tiles * tile)[:, :rows]
    out = out.view(num_kv, n, groups, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
    return out, lse.view(num_kv, n, groups).permute(1, 0, 2).reshape(n, heads)
