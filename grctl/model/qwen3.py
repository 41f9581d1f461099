"""Our own Qwen3 in plain PyTorch, with fused qkv_proj and gate_up_proj.

Parameter names are the HF names without `model.`, fused: `embed_tokens.weight`,
`layers.{i}.self_attn.qkv_proj.weight`, `layers.{i}.mlp.gate_up_proj.weight`, `norm.weight`,
`lm_head.weight` (absent when tied: the head reads `embed_tokens.weight`). Weights are only ever
written in place (grctl.weights.apply), so the storage of every parameter is fixed for the life
of the model and CUDA graphs captured over it stay valid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grctl.model import batch_invariant
from grctl.model.config import ModelConfig
from grctl.model.rope import rope_cos_sin


class Invariant:
    """A module whose matmuls and norms may run batch-invariant (batch_invariant.py):
    `Qwen3ForCausalLM.set_batch_invariant` sets `invariant` on every such module."""

    invariant = False

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(x, weight) if self.invariant else F.linear(x, weight)


class RMSNorm(Invariant, nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return batch_invariant.rms_norm(x, self.weight, self.eps)
        dtype, weight = x.dtype, self.weight
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(self.eps))
        y = y.to(dtype)
        # the same values as `weight * y`, without a second full-size tensor when the dtypes
        # allow it in place (norms were 14-16 % of a CPU flood's engine time)
        in_place = not torch.is_grad_enabled() and torch.result_type(y, weight) == y.dtype
        return y.mul_(weight) if in_place else weight * y


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [..., seq, heads, head_dim]; cos/sin: [..., seq, head_dim]
    # x * cos + rotate_half(x) * sin, written per half so that neither the rotated copy nor its
    # negation is materialised: (-b) * s + a == a - b * s exactly, so the values are the same
    half = x.shape[-1] // 2
    xf = x.float()
    if torch.is_grad_enabled():  # a trainer's forward: out= and in-place ops break autograd
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return (xf * cos + rotated * sin).to(x.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    shape = torch.broadcast_shapes(x.shape, cos.shape)
    out = torch.empty(shape, dtype=torch.result_type(xf, cos), device=x.device)
    lo, hi = out[..., :half], out[..., half:]
    torch.mul(x1, cos[..., :half], out=lo)
    lo -= x2 * sin[..., :half]
    torch.mul(x2, cos[..., half:], out=hi)
    hi += x1 * sin[..., half:]
    return out.to(x.dtype)


class Qwen3Attention(Invariant, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., seq, hidden] -> q [..., seq, H, D], k and v [..., seq, KV, D], RoPE applied."""
        qkv = self._linear(x, self.qkv_proj.weight)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim)))
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q alone, for rows whose k and v are not needed: [..., hidden] -> [..., H, D]."""
        q = self._linear(x, self.qkv_proj.weight[: self.q_size])
        return apply_rope(self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))), cos, sin)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v alone, for rows whose q is not needed: [..., hidden] -> [..., KV, D] each."""
        k, v = self._linear(x, self.qkv_proj.weight[self.q_size :]).split(self.kv_size, dim=-1)
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return apply_rope(k, cos, sin), v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Causal attention over [past + x] for a batch of equal-length rows.

        x: [batch, seq, hidden]; past_kv: k, v of shape [batch, past, KV, D].
        Returns the output [batch, seq, hidden] and the new (k, v) of this call only.
        """
        q, k, v = self.project(x, cos, sin)
        new_kv = (k, v)
        if past_kv is not None:
            k = torch.cat((past_kv[0], k), dim=1)
            v = torch.cat((past_kv[1], v), dim=1)
        seq, total = q.shape[1], k.shape[1]
        groups = self.num_heads // self.num_kv_heads
        qh = q.transpose(1, 2)  # [batch, H, seq, D]
        kh = k.transpose(1, 2).repeat_interleave(groups, dim=1)  # [batch, H, total, D]
        vh = v.transpose(1, 2).repeat_interleave(groups, dim=1)
        mask = torch.ones(seq, total, dtype=torch.bool, device=x.device).tril(total - seq)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return self._linear(out.transpose(1, 2).flatten(-2), self.o_proj.weight), new_kv


class Qwen3MLP(Invariant, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(x, self.gate_up_proj.weight).chunk(2, dim=-1)
        # in place: one [rows, inter] buffer less
        return self._linear(F.silu(gate).mul_(up), self.down_proj.weight)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # The engine runs a layer in two dense halves around its own attention (and on CUDA captures
    # each half in a graph): [rows, hidden] in, q [rows, H, D] and k, v [rows, KV, D] out ...
    def pre_attention(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(self.input_layernorm(h), cos, sin)

    # ... and the attention output [rows, H * D] back into the residual stream [rows, hidden].
    def post_attention(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn._linear(attn, self.self_attn.o_proj.weight)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3ForCausalLM(Invariant, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(self.norm(hidden), self.lm_head_weight).float()

    def set_batch_invariant(self, on: bool) -> None:
        """Every matmul and norm batch-invariant (batch_invariant.py), or back to the plain
        kernels: --enable-deterministic-inference."""
        for module in self.modules():
            if isinstance(module, Invariant):
                module.invariant = on

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        past_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Plain causal forward over equal-length rows: the reference path.

        input_ids: [batch, seq]. past_kv: per layer (k, v) [batch, past, KV, D].
        Returns float32 logits [batch, seq, vocab] and per-layer KV of past + this call.
        """
        past = 0 if not past_kv else past_kv[0][0].shape[1]
        if positions is None:
            positions = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
            positions = positions.expand(input_ids.shape[0], -1)
        # transformers' dynamic RoPE sizes its frequencies by the call's longest position
        seq_lens = torch.full_like(positions, int(positions.max()) + 1)
        cos, sin = rope_cos_sin(positions, self.config, seq_lens)
        h = self.embed_tokens(input_ids)
        kv_out = []
        for i, layer in enumerate(self.layers):
            layer_past = past_kv[i] if past_kv else None
            attn, (k, v) = layer.self_attn(layer.input_layernorm(h), cos, sin, layer_past)
            h = h + attn
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if layer_past is not None:
                k = torch.cat((layer_past[0], k), dim=1)
                v = torch.cat((layer_past[1], v), dim=1)
            kv_out.append((k, v))
        return self.logits(h), kv_out
