"""Before a tensor push pauses anything: does the source cover the served model?

The server applies chunks as they come (SGLang's protocol), so a source that lacks a tensor
would leave it partly updated. The disk path refuses such a directory before copying; this gives
the tensor path the same check, on the client, with the sink's own plan (apply.plan_against,
require_full) run against the served parameters' shapes (model.parameters, from ModelConfig):
no model built, no memory, no second coverage rule. Names are taken as the server takes a
flattened bucket: HF names only (a fused name would be refused there, part-way through).
"""

from __future__ import annotations

import torch

from grctl.errors import WeightValidationError
from grctl.model.config import ModelConfig
from grctl.model.parameters import parameter_shapes
from grctl.weights import apply


def served_structure(client) -> ModelConfig | None:
    """The served model's structure from /model_info (None from a server that does not say)."""
    config = client.model_info().model_config
    return ModelConfig.from_hf(config) if config else None


def check_covers(client, source) -> None:
    """Raise WeightValidationError unless `source` (a Checkpoint or NamedTensors) matches and
    covers the server's model. A server that does not report its structure is planned against
    the checkpoint's config.json; tensors in memory then go unplanned (the server still
    validates each chunk before applying it)."""
    served = served_structure(client)
    cfg = served or source.config
    if cfg is None:
        return
    if served is not None and source.config is not None:
        mismatches = served.structural_mismatches(source.config)
        if mismatches:
            raise WeightValidationError(
                "checkpoint structure does not match the served model: " + "; ".join(mismatches)
            )
    params = {n: torch.empty(s, device="meta") for n, s in parameter_shapes(cfg).items()}
    apply.plan_against(cfg, params, source.specs(), require_full=True, allow_fused=False)
