"""The two attention shapes of the GR workload, in plain PyTorch.

Prefill: causal self-attention over one prompt. Decode: a request's beams attend to the shared
context KV (read once for all beams: GQA groups and beams are folded into the query rows of one
batched matmul per KV head) plus each beam's own short tail of decoded-token KV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# enable_gqa lets SDPA read K/V with fewer heads than Q without materialising repeats (torch 2.5+).
_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """q [S_q, H, D]; k, v [KV, S, D] -> [S_q, H * D].

    causal=True: S_q == S and row i sees keys 0..i. causal=False: every query sees every key
    (the prompt's last token alone, in the last layer).
    """
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, S_q, D]
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # [1, KV, S, D]
    groups = q.shape[1] // k.shape[0]
    if _HAS_GQA:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=groups > 1)
    else:
        kh = kh.repeat_interleave(groups, dim=1)
        vh = vh.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    return out[0].transpose(0, 1).flatten(1)


def decode_attention(
    q: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    beam_k: torch.Tensor,
    beam_v: torch.Tensor,
) -> torch.Tensor:
    """One new token per beam of one request.

    q [n, H, D]; ctx_k, ctx_v [KV, C, D] shared by all beams; beam_k, beam_v [n, KV, t, D]
    (the beam's own decoded tokens, the current one included). Returns [n, H * D].
    """
    n, num_heads, head_dim = q.shape
    num_kv, ctx_len = ctx_k.shape[0], ctx_k.shape[1]
    groups, t = num_heads // num_kv, beam_k.shape[2]
    qg = q.view(n, num_kv, groups, head_dim)  # q head h reads kv head h // groups
    q_ctx = qg.transpose(0, 1).reshape(num_kv, n * groups, head_dim)
    s_ctx = torch.matmul(q_ctx, ctx_k.transpose(1, 2))  # [KV, n*g, C]
    s_beam = torch.matmul(qg, beam_k.transpose(2, 3))  # [n, KV, g, t]
    s_beam = s_beam.transpose(0, 1).reshape(num_kv, n * groups, t)
    scores = torch.cat((s_ctx, s_beam), dim=-1).float() * head_dim**-0.5
    p = scores.softmax(dim=-1).to(q.dtype)  # [KV, n*g, C+t]
    o_ctx = torch.matmul(p[..., :ctx_len], ctx_v)  # [KV, n*g, D]
    p_beam = p[..., ctx_len:].reshape(num_kv, n, groups, t).transpose(0, 1)  # [n, KV, g, t]
    o_beam = torch.matmul(p_beam, beam_v)  # [n, KV, g, D]
    out = o_ctx.view(num_kv, n, groups, head_dim).transpose(0, 1) + o_beam
    return out.reshape(n, num_heads * head_dim)
