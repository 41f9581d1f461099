"""The plan a tensor push runs before any pause, against a server's reported structure: it
builds no model, refuses a source that lacks a tensor, has another structure, or names a fused
parameter (which the server would refuse part-way through), and says nothing it cannot know."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from grctl.client.preflight import check_covers
from grctl.client.sources import NamedTensors
from grctl.errors import WeightValidationError
from grctl.model import qwen3
from grctl.weights.checkpoint import Checkpoint
from tests.support.checkpoints import make_hf_model


@dataclasses.dataclass
class ModelInfo:
    model_config: dict | None


class FakeClient:
    """/model_info as a grctl server (its config.json) or an older server (none) answers it."""

    def __init__(self, config: dict | None):
        self.config = config

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.config)


@pytest.fixture()
def hf():
    return make_hf_model(seed=3)


@pytest.fixture()
def served(hf) -> FakeClient:
    return FakeClient(hf.config.to_dict())


def test_the_plan_builds_no_model(monkeypatch, hf, served, tiny_checkpoint):
    def refuse(*args, **kw):
        raise AssertionError("the plan built a model")

    monkeypatch.setattr(qwen3.Qwen3ForCausalLM, "__init__", refuse)
    check_covers(served, NamedTensors(hf.state_dict()))
    with Checkpoint(tiny_checkpoint) as ckpt:
        check_covers(served, ckpt)


def test_a_missing_tensor_is_named(hf, served):
    state = hf.state_dict()
    del state["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(WeightValidationError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        check_covers(served, NamedTensors(state))


def test_a_wrong_shape_is_named(hf, served):
    state = hf.state_dict()
    state["model.norm.weight"] = torch.ones(7)
    with pytest.raises(WeightValidationError, match=r"model\.norm\.weight.*shape \[7\]"):
        check_covers(served, NamedTensors(state))


def test_another_structure_is_refused(served, checkpoint):
    with Checkpoint(checkpoint(seed=3, intermediate_size=80)) as ckpt:
        with pytest.raises(WeightValidationError, match="intermediate_size: served 96"):
            check_covers(served, ckpt)


def test_fused_names_are_refused(hf, served, tmp_path, tiny_checkpoint):
    """The server takes HF names only in a flattened bucket: a fused one would be refused at
    its bucket, after the earlier buckets were applied."""
    p = "model.layers.1.self_attn."
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    parts = [tensors.pop(p + f"{m}.weight") for m in ("q_proj", "k_proj", "v_proj")]
    tensors[p + "qkv_proj.weight"] = torch.cat(parts)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    served = FakeClient(json.loads((tiny_checkpoint / "config.json").read_text()))
    with Checkpoint(tmp_path) as ckpt, pytest.raises(WeightValidationError, match="qkv_proj"):
        check_covers(served, ckpt)


def test_what_a_server_without_its_structure_is_planned_against(hf, tiny_checkpoint):
    silent = FakeClient(None)
    with Checkpoint(tiny_checkpoint) as ckpt:
        check_covers(silent, ckpt)  # against the checkpoint's own config.json
    state = hf.state_dict()
    del state["model.norm.weight"]
    check_covers(silent, NamedTensors(state))  # nothing to plan against: the server checks
