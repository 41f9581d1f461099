"""The two attention shapes of the GR workload.

Prefill: causal self-attention over one prompt. Decode: the beams of every running request attend
to their request's shared context KV (read once for all of its beams) plus each beam's own short
tail of decoded-token KV. Decode runs as two batched calls per layer whatever the number of
requests, merged by their log-sum-exp:
- the context part: one fused attention over the requests' contexts padded to one length, each
  request's beams and GQA groups folded into its query rows ([R, KV, Q, D] against [R, KV, C, D]),
  returning the output and the log-sum-exp of its scores (kernels keep scores in fp32);
- the tail part: a few keys per beam, computed in fp32 ([rows, KV, g, T]).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("grctl.engine")

# enable_gqa lets SDPA read K/V with fewer heads than Q without materialising repeats (torch 2.5+).
_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
_NEG_INF = float("-inf")


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


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, L, D]; k, v [B, H, S, D]; key_bias [B, 1, 1, S] (0 or -inf, q's dtype) or None.

    -> out [B, H, L, D] in q's dtype, lse [B, H, L] in float32 (natural log of the sum of the
    scaled scores' exponentials). One fused kernel call, scores never leave fp32.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=key_bias
        )
        return out, lse
    if q.device.type == "cuda" and _cuda_fused[0]:
        try:
            return _cuda_attention_with_lse(q, k, v, key_bias)
        except RuntimeError:  # an unsupported shape or dtype: the math path is exact, slower
            log.exception("fused CUDA decode attention failed; decode attention runs unfused")
            _cuda_fused[0] = False
    return math_attention_with_lse(q, k, v, key_bias)


_cuda_fused = [True]  # cleared once the fused CUDA kernel refuses a shape (logged)


def _cuda_attention_with_lse(q, k, v, key_bias):
    # Memory-efficient attention returns the log-sum-exp; its bias must be [B, H, L, S] (stride
    # 0 broadcasts are fine) with the key dimension 16-aligned in memory, so it is allocated
    # padded and sliced.
    bias = None
    if key_bias is not None:
        b, s = key_bias.shape[0], key_bias.shape[-1]
        padded = torch.zeros(b, 1, 1, -(-s // 16) * 16, dtype=q.dtype, device=q.device)
        padded[..., :s] = key_bias
        bias = padded[..., :s].expand(b, q.shape[1], q.shape[2], s)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
    return out, lse[..., : q.shape[2]].float()


def math_attention_with_lse(q, k, v, key_bias):
    """The reference: scores in float32, then softmax, then the weighted sum."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if key_bias is not None:
        scores = scores + key_bias.float()
    lse = scores.logsumexp(-1)
    out = torch.matmul((scores - lse[..., None]).exp(), v.float())
    return out.to(q.dtype), lse


def tail_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each beam's own decoded tokens, in float32.

    q [rows, KV, g, D]; k, v [rows, KV, T, D]; valid [rows, T] (a beam at step s sees s + 1
    keys, always at least one). -> out [rows, KV, g, D] float32, lse [rows, KV, g].
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~valid[:, None, None, :], _NEG_INF)
    lse = scores.logsumexp(-1)
    return torch.matmul((scores - lse[..., None]).exp(), v.float()), lse


def merge(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over keys A and B together, from each part's normalised output and its lse
    (same leading shape; outputs [..., D]). Float32."""
    lse = torch.logaddexp(lse_a, lse_b)
    return o_a.float() * (lse_a - lse).exp()[..., None] + o_b * (lse_b - lse).exp()[..., None]
