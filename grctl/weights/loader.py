"""Building the served model: from a checkpoint directory or the built-in default model.

Start-up goes through the same sources and sink as a live update (a Checkpoint, or the built-in
model's weights -> apply.plan -> apply.copy), streaming tensor by tensor into storage allocated
once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grctl.errors import ValidationError
from grctl.model.builtin import DEFAULT_CONFIG, builtin_weights
from grctl.model.config import ModelConfig
from grctl.model.device import resolve_device
from grctl.model.dtypes import SERVED_DTYPES, name_of
from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.weights import apply
from grctl.weights.checkpoint import Checkpoint, copy_checkpoint, plan_checkpoint


def resolve_dtype(dtype: str, cfg: ModelConfig) -> torch.dtype:
    name = (cfg.torch_dtype or "float32") if dtype == "auto" else dtype
    if name not in SERVED_DTYPES:
        raise ValidationError(f"unsupported dtype {name!r}; use one of bfloat16, float16, float32")
    return SERVED_DTYPES[name]


def empty_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """Allocate the model's storage once, uninitialised: the load writes every element."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    return model.to_empty(device=device).eval()


def load_checkpoint_into(model: Qwen3ForCausalLM, ckpt: Checkpoint) -> int:
    """Validate a whole checkpoint against the live model from headers, then stream it in."""
    return copy_checkpoint(plan_checkpoint(model, ckpt), ckpt)


def load_model(
    model_path: str | Path | None, device: str = "cpu", dtype: str = "auto"
) -> Qwen3ForCausalLM:
    """The model to serve: a checkpoint directory, or the built-in model when path is None."""
    dev = resolve_device(device)
    if model_path is None:
        model = empty_model(DEFAULT_CONFIG, dev, resolve_dtype(dtype, DEFAULT_CONFIG))
        apply.load_tensors(model, list(builtin_weights(model)), require_full=True)
        return model
    with Checkpoint(model_path) as ckpt:
        model = empty_model(ckpt.config, dev, resolve_dtype(dtype, ckpt.config))
        load_checkpoint_into(model, ckpt)
    return model


def export_hf(model: Qwen3ForCausalLM, out_dir: str | Path) -> Path:
    """Write `model` as an HF checkpoint (config.json + model.safetensors, HF split names)."""
    from safetensors.torch import save_file

    from grctl.weights.views import hf_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    dtype_name = name_of(next(model.parameters()).dtype)
    hf_cfg = {**cfg.to_hf(), "torch_dtype": dtype_name}
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    tensors = {k: v.detach().cpu().contiguous() for k, v in hf_state_dict(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
