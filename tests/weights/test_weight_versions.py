"""WeightVersions and the engine's mixed-label guard, on the built-in model (no server)."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import WeightsMixed, WeightsMixedConflict
from grctl.model.builtin import DEFAULT_CONFIG
from grctl.weights import apply
from grctl.weights.loader import load_model
from grctl.weights.mapping import hf_names
from grctl.weights.updater import WeightUpdater
from grctl.weights.versions import WeightVersions

NUM_TENSORS = len(hf_names(DEFAULT_CONFIG))  # tied: no lm_head of its own


def req() -> GenerateRequest:
    return GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=1))


@pytest.fixture(scope="module")
def model():
    return load_model(None)


def serve(model, **cfg) -> tuple[Engine, WeightUpdater]:
    """An engine and its one updater, the owner of its labels."""
    engine = Engine(model, EngineConfig(**cfg))
    return engine, WeightUpdater(engine)


def push(updater: WeightUpdater, named: list[tuple[str, torch.Tensor]], label: str | None, **kw):
    """One chunk through the real updater (plan, copy, labels)."""
    direct = kw.pop("direct", False)
    return updater.run(
        lambda: apply.plan(
            updater.model,
            apply.specs_of(named),
            require_full=False,
            allow_fused=direct,
            allow_split=not direct,
        ),
        dict(named).__getitem__,
        weight_version=label,
        **kw,
    )


def hf_tensor(engine: Engine, name: str) -> torch.Tensor:
    from grctl.weights.views import hf_view

    return hf_view(engine.model, name).clone()


def test_a_q_proj_only_chunk_labels_only_its_rows(model):
    engine, updater = serve(model, weight_version="A")
    q = "model.layers.0.self_attn.q_proj.weight"
    push(updater, [(q, hf_tensor(engine, q))], "B")
    labels = updater.versions.labels()
    assert labels[q] == "B" and labels["model.layers.0.self_attn.k_proj.weight"] == "A"
    assert updater.versions.label_counts() == {"A": NUM_TENSORS - 1, "B": 1}
    assert engine.is_weights_mixed and "weights_mixed" in engine.ready_reasons()
    with pytest.raises(WeightsMixed) as refused:
        engine.submit(req())
    assert refused.value.status == 503 and f"{NUM_TENSORS - 1} carry version 'A'" in str(
        refused.value
    )
    engine.pause("abort")
    with pytest.raises(WeightsMixedConflict):
        engine.resume()
    assert engine.is_paused  # refused: still paused
    # A fused name (load_format direct) covers q, k and v at once.
    fused = "layers.0.self_attn.qkv_proj.weight"
    qkv = model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    push(updater, [(fused, qkv)], "B", direct=True)
    assert updater.versions.label_counts()["B"] == 3
    updater.set_version("B")
    assert not engine.is_weights_mixed
    engine.resume()
    assert engine.submit(req())


def test_unlabelled_updates_keep_labels_and_empty_ones_only_move_the_label(model):
    engine, updater = serve(model, weight_version="A")
    name = "model.norm.weight"
    push(updater, [(name, hf_tensor(engine, name))], None)  # SGLang's unlabelled single update
    assert updater.versions.label_counts() == {"A": NUM_TENSORS} and not engine.is_weights_mixed
    assert updater.versions.update_count == 1
    # tied lm_head lands in the embedding: the embedding's label moves
    push(updater, [("lm_head.weight", hf_tensor(engine, "model.embed_tokens.weight"))], "C")
    assert updater.versions.labels()["model.embed_tokens.weight"] == "C"
    assert engine.weight_version == "C"


def test_a_full_update_labels_every_tensor():
    versions = WeightVersions(DEFAULT_CONFIG, "A")
    versions.record(["model.norm.weight"], "B")
    assert versions.is_mixed
    versions.record([], None, is_full=True)  # a whole checkpoint, no label: the current one
    assert versions.label_counts() == {"B": NUM_TENSORS} and not versions.is_mixed


def test_allow_partial_updates_serves_a_mix(model):
    engine, updater = serve(model, weight_version="A", allow_partial_updates=True)
    push(updater, [("model.norm.weight", hf_tensor(engine, "model.norm.weight"))], "B")
    assert updater.versions.is_mixed and not engine.is_weights_mixed
    assert engine.ready_reasons() == ["worker_not_running"]
    rid = engine.submit(req())
    while engine.run_step():
        pass
    assert engine.result(rid).weight_versions == ["B"]


def test_relabel_while_a_request_runs_is_allowed_and_reported(model):
    """SGLang's /update_weight_version with abort_all_requests false: no 409; the request goes on
    and lists both labels."""
    engine, updater = serve(model, weight_version="A")
    rid = engine.submit(GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=4)))
    assert engine.run_step()  # prefill under A: the request is in flight, nothing paused
    assert updater.set_version("B", abort_all_requests=False) == 0
    while engine.run_step():
        pass
    result = engine.result(rid)
    assert result.finish_reason == "length" and result.weight_versions == ["A", "B"]
    assert updater.versions.label_counts() == {"B": NUM_TENSORS}
