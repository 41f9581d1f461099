"""Batch-invariant kernels: each row's result depends on that row's inputs alone, never on how
many other rows share the call, where the row sits in it, or how a context is split in memory.

What varies otherwise: a GEMM's kernel and blocking follow its row count M (one row takes a
GEMV, a few rows another micro-kernel), so the same token's projection differs in its last bits
alone and in a batch; a reduction's split follows its shape; attention's order follows how its
queries and keys are cut (a prefix-cache hit attends in two parts, a miss in one). Here:

- `linear`: on the CPU, the rows cut into as many equal chunks as there are threads (at least
  two, of MIN_CHUNK rows or more; the last chunk's few missing rows zero-padded), run as one
  batched matmul over a stride-0 weight. torch runs each chunk's GEMM on one thread (inside its
  parallel loop), and a one-thread MKL GEMM gives a row the same bits for any row count from
  MIN_CHUNK up and at any place in the call; what follows the row count is the threaded GEMM's
  split of K, which this never takes. The cost is one GEMM's, where fixed tiles re-read the
  weight once per 32 rows. Elsewhere (CUDA: its kernels follow the shape) every tile is the
  same [ROW_TILE, K] x [K, N] product: one shape, one kernel, one reduction order.
- `rms_norm`: the mean of squares as the same tiled product against columns of ones.
- `attention`: query rows in fixed tiles against keys cut at fixed absolute positions. On the
  CPU, torch's flash kernel per tile: a decode tile against the whole context (its kv blocks
  start at key 0 and their size follows the key count alone); causal (prefill) tiles against
  blocks of PREFILL_KEY_BLOCK keys, one call per block for the tiles that reach it (the
  kernel's own kv block is then the block: it does not follow the key count), merged by
  log-sum-exp in position order, a block wholly past a row's position left out of its merge
  (so a tile costs about its causal share, not every key up to a 512-key boundary); elsewhere
  blocks of KEY_BLOCK keys, each block's scores and weighted values as fixed-shape products,
  merged one after another in position order (online softmax: a fully masked block leaves the
  running sums exactly as they were). A row's output is a function of its query, its position
  and the keys before it (a decode row: of the whole context), whatever else the call holds.

Written for CUDA too (the same shapes give cuBLAS the same kernel), where it is untested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 32  # rows of every matmul tile off the CPU
MIN_CHUNK = 16  # the fewest rows of a CPU GEMM chunk (MKL's small-M kernels differ below)
KEY_BLOCK = 64  # keys of every attention block
CHUNK_BYTES = 64 << 20  # attention's temporaries per chunk of query tiles
PREFILL_TILE = 64  # query rows of a causal (prefill) attention tile on the CPU
PREFILL_KEY_BLOCK = 128  # keys of a causal attention block on the CPU (one flash call each)


def _tiles(x: torch.Tensor, tile: int = ROW_TILE) -> tuple[torch.Tensor, int]:
    """x [rows, K] -> [tiles, tile, K] (zero rows appended), and the row count."""
    rows = x.shape[0]
    pad = -rows % tile
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    return x.view(-1, tile, x.shape[1]), rows


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias), row-invariant: x [..., K], weight [N, K] -> [..., N]."""
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if x.device.type == "cpu":
        out = _chunked(flat, weight)
    else:
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


def _chunked(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """flat [rows, K] @ weight.T as one-thread GEMMs of equal chunks, one per thread."""
    rows, k = flat.shape
    n = weight.shape[0]
    threads = torch.get_num_threads()
    # two chunks at least: one alone runs outside torch's parallel loop, on every thread
    chunks = max(2, min(threads, rows // MIN_CHUNK)) if threads > 1 else 1
    size = max(MIN_CHUNK, -(-rows // chunks))
    pad = chunks * size - rows
    if pad:
        flat = torch.nn.functional.pad(flat, (0, 0, 0, pad))
    out = torch.bmm(flat.view(chunks, size, k), weight.t().expand(chunks, k, n))
    return out.view(-1, n)[:rows]


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
    """The CPU path: torch's fused flash attention over query tiles. Its kv blocks start at key
    0 and their size follows the key count alone, its query block follows the tile, so every
    row meets the same products and the same reduction order."""
    n, heads, dim = q.shape
    num_kv = k.shape[0]
    groups = heads // num_kv
    rows = n * groups
    # a prefill's rows in tiles of PREFILL_TILE (the kernel's query blocks of 32), a decode
    # step's few in tiles of ROW_TILE (one query block of 32)
    tile = PREFILL_TILE if q_pos is not None else ROW_TILE
    qr = q.view(n, num_kv, groups, dim).permute(1, 0, 2, 3).reshape(num_kv, rows, dim)
    pad = -rows % tile
    if pad:
        qr = F.pad(qr, (0, 0, 0, pad))
    tiles = qr.shape[1] // tile
    qt = qr.view(num_kv, tiles, tile, dim).transpose(0, 1)  # [T, KV, tile, D]
    if q_pos is None:
        out, lse = _flash(qt, k, v, None)
    else:
        limit = q_pos.to(q.device).repeat_interleave(groups)
        if pad:  # padding rows see what the last row sees (nothing of theirs is kept)
            limit = F.pad(limit, (0, pad), value=int(limit[-1]))
        out, lse = _causal_blocks(qt, k, v, limit.view(tiles, tile))
    out = out.float().transpose(0, 1).reshape(num_kv, tiles * tile, dim)[:, :rows]
    lse = lse.float().transpose(0, 1).reshape(num_kv, tiles * tile)[:, :rows]
    out = out.view(num_kv, n, groups, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
    return out, lse.view(num_kv, n, groups).permute(1, 0, 2).reshape(n, heads)


def _causal_blocks(qt, k, v, limit):
    """Causal rows: qt [T, KV, tile, D] query tiles in position order, k, v [KV, S, D], limit
    [T, tile] each row's last key. Keys in blocks of PREFILL_KEY_BLOCK at absolute positions,
    each block one flash call for the tiles that reach it (its diagonal masked), the blocks'
    results merged by log-sum-exp in position order. A row meets the same blocks, the same
    products and the same merges whatever shares its call; a block wholly past a row's position
    is left out of its merge. -> out [T, KV, tile, D] float32, lse [T, KV, tile]."""
    kb = PREFILL_KEY_BLOCK
    last = limit.amax(1).tolist()  # nondecreasing: the tiles are in position order
    blocks = int(max(last)) // kb + 1
    kpad = blocks * kb - k.shape[1]
    if kpad > 0:
        k, v = F.pad(k, (0, 0, 0, kpad)), F.pad(v, (0, 0, 0, kpad))
    offsets = torch.arange(kb, device=qt.device)
    done_o, done_m = [], []  # the tiles no later block reaches, in order
    run_o = run_m = None  # the merged blocks so far of tiles base ..
    base = 0
    for j in range(blocks):
        lo = next(i for i, p in enumerate(last) if p >= j * kb)  # the tiles that reach block j
        lim = limit[lo:, :, None]
        hidden = j * kb + offsets > lim  # [t, tile, kb]
        mask = torch.zeros(hidden.shape, dtype=qt.dtype, device=qt.device)
        mask = mask.masked_fill_(hidden, float("-inf")).unsqueeze(1)
        o, m = _flash(qt[lo:], k[:, j * kb : (j + 1) * kb], v[:, j * kb : (j + 1) * kb], mask)
        o, m = o.float(), m.float()
        if run_o is None:
            run_o, run_m, base = o, m, lo
            continue
        if lo > base:  # no block from here on reaches tiles base .. lo - 1
            done_o.append(run_o[: lo - base])
            done_m.append(run_m[: lo - base])
            run_o, run_m, base = run_o[lo - base :], run_m[lo - base :], lo
        seen = (lim[..., 0] >= j * kb).unsqueeze(1)  # [t, 1, tile]: the block holds its keys
        top = torch.maximum(run_m, m)
        a, b = (run_m - top).exp(), (m - top).exp()
        total = a + b
        merged = (run_o * a[..., None] + o * b[..., None]) / total[..., None]
        run_o = torch.where(seen[..., None], merged, run_o)
        run_m = torch.where(seen, top + total.log(), run_m)
    return torch.cat((*done_o, run_o)), torch.cat((*done_m, run_m))


def _flash(qt, k, v, mask):
    """qt [T, KV, tile, D] against k, v [KV, S, D] (every tile the same keys) -> out, lse.
    The kernel's backward treats its lse as a constant; where a gradient is wanted (a trainer's
    forward, grctl.rl.forward) the lse gets the gradient of the same value written out (its
    value stays the kernel's, bit for bit), since the merges that follow weigh by it."""
    tiles = qt.shape[0]
    kt = k.unsqueeze(0).expand(tiles, *k.shape)
    vt = v.unsqueeze(0).expand(tiles, *v.shape)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qt, kt, vt, attn_mask=mask
    )
    if torch.is_grad_enabled() and (qt.requires_grad or k.requires_grad):
        scores = torch.matmul(qt, k.transpose(-1, -2)) * qt.shape[-1] ** -0.5
        if mask is not None:  # finite: a row all masked has a gradient of 0, not NaN
            scores = scores + mask.clamp(min=-1e30)
        ex = torch.logsumexp(scores.float(), -1)
        lse = lse.detach() + (ex - ex.detach())
    return out, lse
