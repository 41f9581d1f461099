"""model.parameters: the served parameters' names and shapes from ModelConfig alone are exactly
those of the model built from it, tied or not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grctl.model.builtin import DEFAULT_CONFIG
from grctl.model.config import ModelConfig
from grctl.model.parameters import parameter_shapes
from grctl.model.qwen3 import Qwen3ForCausalLM
from tests.support.checkpoints import hf_config


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("source", ["tiny", "builtin"])
def test_shapes_are_the_built_models(source, tied):
    cfg = ModelConfig.from_hf(hf_config().to_dict()) if source == "tiny" else DEFAULT_CONFIG
    cfg = dataclasses.replace(cfg, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    built = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert list(parameter_shapes(cfg).items()) == built
