"""The two attention shapes of the GR workload.

Prefill: causal self-attention over one prompt. Decode: the beams of every running request attend
to their request's shared context KV (read once for all of its beams, where it lies) plus each
beam's own short tail of decoded-token KV; the parts are merged by their log-sum-exp:
- a context part: one fused attention call, the request's beams and GQA groups folded into the
  query rows ([1, KV, Q, D] against the part's own [1, KV, C, D]), returning the output and the
  log-sum-exp of its scores (kernels keep scores in fp32);
- the tail part: a few keys per beam, computed in fp32 ([rows, KV, g, T]).
The engine's layout of a step over these calls is engine/decode_batch.py.
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

    causal=True: the queries are the last S_q of the S tokens (all of them, or those after a
    cached prefix), row i sees keys 0..S - S_q + i. causal=False: every query sees every key
    (the prompt's last token alone, in the last layer).
    """
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, S_q, D]
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # [1, KV, S, D]
    groups = q.shape[1] // k.shape[0]
    mask = None
    if causal and q.shape[0] != k.shape[1]:  # SDPA's is_causal aligns the first rows, not last
        mask = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q.device)
        mask = mask.tril(k.shape[1] - q.shape[0])
        causal = False
    if _HAS_GQA:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=causal, enable_gqa=groups > 1
        )
    else:
        kh = kh.repeat_interleave(groups, dim=1)
        vh = vh.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal)
    return out[0].transpose(0, 1).flatten(1)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, L, D]; k, v [B, H, S, D]: every query sees every key (strided views are fine, the
    last dimension contiguous).

    -> out [B, H, L, D] in q's dtype, lse [B, H, L] in float32 (natural log of the sum of the
    scaled scores' exponentials). One fused kernel call, scores never leave fp32.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        return out, lse
    if q.device.type == "cuda" and _cuda_fused[0]:
        try:
            # memory-efficient attention returns the log-sum-exp (padded to 32 query rows)
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True
            )
            return out, lse[..., : q.shape[2]].float()
        except RuntimeError:  # an unsupported shape or dtype: the math path is exact, slower
            log.exception("fused CUDA decode attention failed; decode attention runs unfused")
            _cuda_fused[0] = False
    return math_attention_with_lse(q, k, v)


_cuda_fused = [True]  # cleared once the fused CUDA kernel refuses a shape (logged)


def math_attention_with_lse(q, k, v):
    """The reference: scores in float32, then softmax, then the weighted sum."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = scores.logsumexp(-1)
    out = torch.matmul((scores - lse[..., None]).exp(), v.float())
    return out.to(q.dtype), lse


def tail_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each beam's own decoded tokens, in float32.

    q [rows, KV, g, D]; k, v [rows, KV, T, D]; valid [rows, T] (a beam at step s sees s + 1
    keys, always at least one) or None (every row sees all T). -> out [rows, KV, g, D] float32,
    lse [rows, KV, g].
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None, :], _NEG_INF)
    lse = scores.logsumexp(-1)
    return torch.matmul((scores - lse[..., None]).exp(), v.float()), lse


def merge(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B together, from each part's normalised output and its lse
    (same leading shape; outputs [..., D]) -> (out, lse), float32."""
    # max + log(sum of exps), not torch.logaddexp: its vectorised and scalar kernels differ in
    # the last bit, so a row's merge would follow where it falls in the batch's buffer
    peak = torch.maximum(lse_a, lse_b)
    lse = peak + ((lse_a - peak).exp() + (lse_b - peak).exp()).log()
    w_a, w_b = (lse_a - lse).exp()[..., None], (lse_b - lse).exp()[..., None]
    out = o_a.float() * w_a + o_b.float() * w_b
    return out, lse
