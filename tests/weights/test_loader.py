"""Start-up loading: every --dtype the engine config accepts builds the served model in it."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import DTYPE_CHOICES, EngineConfig
from grctl.errors import ValidationError
from grctl.weights.loader import load_model

NAMED = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def test_config_accepts_exactly_the_served_dtype_names():
    assert set(DTYPE_CHOICES) == {"auto", *NAMED}
    with pytest.raises(ValidationError, match="unsupported dtype 'int8'"):
        EngineConfig(dtype="int8")


@pytest.mark.parametrize("name", sorted(NAMED))
def test_every_accepted_dtype_loads(name):
    """The config and the loader read one table: bf16 passes both (the config once refused it)."""
    model = load_model(None, dtype=EngineConfig(dtype=name).dtype)
    assert {p.dtype for p in model.parameters()} == {NAMED[name]}
