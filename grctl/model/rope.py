"""Rotary position embeddings, with the scaling types transformers' Qwen3 supports.

`RopeScaling.from_hf` reads `rope_parameters` (transformers 5) or `rope_scaling` (older
configs): rope_type default, linear, dynamic (NTK), yarn or llama3; any other type is refused, so a
model never loads with positions it would encode wrongly. Frequencies follow the published methods
as transformers implements them (same formulas, float32, same order of operations):
- linear: every inverse frequency divided by `factor`;
- dynamic: the base grows with the sequence length past max_position_embeddings,
  base * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2)), L per token (see rope_cos_sin);
- yarn: interpolated low frequencies and extrapolated high ones, blended by a linear ramp between
  the dimensions that rotate beta_fast and beta_slow times over the original length, and cos/sin
  scaled by an attention factor (0.1 * ln(factor) + 1 unless given);
- llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from grctl.errors import ValidationError

SUPPORTED = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # yarn, llama3
    attention_factor: float = 1.0  # yarn: scales cos and sin
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3

    @classmethod
    def from_hf(cls, raw: dict, max_position_embeddings: int) -> RopeScaling:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ValidationError("config.json: rope_parameters / rope_scaling must be an object")
        if any(isinstance(v, dict) for v in params.values()):
            raise ValidationError("config.json: RoPE parameters per layer type are unsupported")
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in SUPPORTED:
            raise ValidationError(
                f"config.json asks for RoPE scaling {kind!r}, which grctl does not implement",
                hint=f"use one of {', '.join(SUPPORTED)}",
            )
        if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValidationError("config.json: partial_rotary_factor other than 1 is unsupported")
        if kind == "default":
            return cls()
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        factor = params.get("factor")
        if factor is None and kind == "yarn":
            factor = max_position_embeddings / original
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ValidationError(f"config.json: RoPE scaling {kind!r} needs a positive factor")
        factor = float(factor)
        attention = params.get("attention_factor")
        if kind == "yarn" and attention is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all:
                attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention = _yarn_mscale(factor)
        return cls(
            rope_type=kind,
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=float(attention if kind == "yarn" else 1.0),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )

    def to_hf(self) -> dict | None:
        if self.rope_type == "default":
            return None
        out = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type in ("yarn", "llama3"):
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "yarn":
            out.update(
                attention_factor=self.attention_factor,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                truncate=self.truncate,
            )
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@functools.lru_cache(maxsize=16)
def inv_freq(head_dim: int, theta: float, rope: RopeScaling, device=None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of every type but dynamic's growth. Computed
    once per device (read-only): a CUDA graph capture then only reads it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    base = 1.0 / (theta**exponents)
    if rope.rope_type == "linear":
        return base / rope.factor
    if rope.rope_type == "yarn":
        return _yarn(head_dim, theta, rope, device)
    if rope.rope_type == "llama3":
        return _llama3(base, rope)
    return base


def _yarn(head_dim: int, theta: float, rope: RopeScaling, device) -> torch.Tensor:
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    original = rope.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device=device)
    keep = 1 - ((dims - low) / (high - low)).clamp(0, 1)  # 1: extrapolate (high frequencies)
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3(base: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    original = rope.original_max_position_embeddings
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / rope.factor, base)
    smooth = (original / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, cfg, seq_lens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for `positions` (any shape) -> [..., head_dim], in float32.

    `seq_lens` (positions' shape) is, for dynamic scaling only, the sequence length each token
    was computed with (a prompt's length for all of its tokens, position + 1 for a decoded one),
    as transformers sees it in the forward call that computes that token; default position + 1.
    """
    rope, dim = cfg.rope, cfg.head_dim
    if rope.rope_type == "dynamic":
        max_pos = cfg.max_position_embeddings
        lens = (positions + 1 if seq_lens is None else seq_lens).clamp(min=max_pos).double()
        bases = cfg.rope_theta * (rope.factor * lens / max_pos - (rope.factor - 1)) ** (
            dim / (dim - 2)
        )
        exponents = torch.arange(0, dim, 2, device=positions.device).float() / dim
        freq = 1.0 / (bases.float()[..., None] ** exponents)  # [..., dim / 2]
    else:
        freq = inv_freq(dim, cfg.rope_theta, rope, positions.device)
    freqs = positions.float()[..., None] * freq
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rope.attention_factor
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale
