"""HF-named views of the live parameters: what a checkpoint of the served model would hold.

Used to read weights back (get_weights_by_name, checksums, export). Views share storage with
the live parameters; nothing here copies or writes.
"""

from __future__ import annotations

import torch
from torch import nn

from grctl.errors import NotFound
from grctl.weights.apply import live_parameters
from grctl.weights.mapping import hf_names, resolve


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every HF tensor name of the served model -> a view of the live parameter."""
    return {name: hf_view(model, name) for name in hf_names(model.config)}


def hf_view(model: nn.Module, name: str) -> torch.Tensor:
    """A view by HF name (`model.layers.0.self_attn.q_proj.weight`, tied `lm_head.weight`) or
    by parameter name (`layers.0.self_attn.qkv_proj.weight`). Unknown names raise NotFound."""
    params = live_parameters(model)
    target = resolve(name, model.config) if isinstance(name, str) else None
    if target is None or target.param_name not in params:
        raise NotFound(
            f"no parameter named {name!r}",
            hint="use an HF name such as 'model.embed_tokens.weight' or a parameter name "
            "such as 'layers.0.self_attn.qkv_proj.weight'",
        )
    param = params[target.param_name]
    return param[target.row_start : target.row_end] if target.is_shard else param


def read_rows(model: nn.Module, name: str, num_rows: int) -> list:
    """The first `num_rows` rows of a view, as float lists (get_weights_by_name's reply)."""
    return hf_view(model, name)[:num_rows].detach().float().cpu().tolist()
