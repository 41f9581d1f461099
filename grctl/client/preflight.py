"""Before a tensor push pauses anything: does the checkpoint cover the served model?

The server applies chunks as they come (SGLang's protocol), so a checkpoint that lacks a tensor
would leave it partly updated. The disk path refuses such a directory before copying; this gives
the tensor path the same check, on the client, with the sink's own plan (apply.plan with
require_full, via plan_checkpoint) run against a meta-device model of the served structure:
no memory, no copy, no second coverage rule.
"""

from __future__ import annotations

import torch

from grctl.model.config import ModelConfig
from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.weights.checkpoint import Checkpoint, plan_checkpoint


def served_structure(client) -> ModelConfig | None:
    """The served model's structure from /model_info (None from a server that does not say)."""
    config = client.model_info().model_config
    return ModelConfig.from_hf(config) if config else None


def check_covers(client, ckpt: Checkpoint) -> None:
    """Raise WeightValidationError unless `ckpt` matches and covers the server's model."""
    cfg = served_structure(client) or ckpt.config
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    plan_checkpoint(model, ckpt)
