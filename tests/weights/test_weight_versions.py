"""WeightVersions and the engine's mixed-label guard, on the built-in model (no server)."""

from __future__ import annotations

import json

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import (
    WeightsInconsistent,
    WeightsInconsistentConflict,
    WeightsMixed,
    WeightsMixedConflict,
)
from grctl.model.builtin import DEFAULT_CONFIG
from grctl.weights import apply
from grctl.weights.apply import WeightCopyError
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
    assert engine.gate.is_mixed and "weights_mixed" in engine.ready_reasons()
    with pytest.raises(WeightsMixed) as refused:
        engine.submit(req())
    assert refused.value.status == 503 and f"{NUM_TENSORS - 1} carry version 'A'" in str(
        refused.value
    )
    engine.pause("abort")
    with pytest.raises(WeightsMixedConflict):
        engine.resume()
    assert engine.gate.is_paused  # refused: still paused
    # A fused name (load_format direct) covers q, k and v at once.
    fused = "layers.0.self_attn.qkv_proj.weight"
    qkv = model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    push(updater, [(fused, qkv)], "B", direct=True)
    assert updater.versions.label_counts()["B"] == 3
    updater.set_version("B")
    assert not engine.gate.is_mixed
    engine.resume()
    assert engine.submit(req())


def test_unlabelled_updates_keep_labels_and_empty_ones_only_move_the_label(model):
    engine, updater = serve(model, weight_version="A")
    name = "model.norm.weight"
    push(updater, [(name, hf_tensor(engine, name))], None)  # SGLang's unlabelled single update
    assert updater.versions.label_counts() == {"A": NUM_TENSORS} and not engine.gate.is_mixed
    assert updater.versions.update_count == 1
    # tied lm_head lands in the embedding: the embedding's label moves
    push(updater, [("lm_head.weight", hf_tensor(engine, "model.embed_tokens.weight"))], "C")
    assert updater.versions.labels()["model.embed_tokens.weight"] == "C"
    assert engine.gate.label == "C"


def test_a_full_update_labels_every_tensor():
    versions = WeightVersions(DEFAULT_CONFIG, "A")
    versions.record(["model.norm.weight"], "B")
    assert versions.is_mixed
    versions.record([], None, is_full=True)  # a whole checkpoint, no label: the current one
    assert versions.label_counts() == {"B": NUM_TENSORS} and not versions.is_mixed


def test_allow_partial_updates_serves_a_mix(model):
    engine, updater = serve(model, weight_version="A", allow_partial_updates=True)
    push(updater, [("model.norm.weight", hf_tensor(engine, "model.norm.weight"))], "B")
    assert updater.versions.is_mixed and not engine.gate.is_mixed
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


# ---- a failed copy: torn marks -------------------------------------------------------------


def failing_fetch(named: list[tuple[str, torch.Tensor]], fail_at: str):
    """A fetch that raises (an I/O error mid-chunk) when it reaches `fail_at`."""
    by_name = dict(named)

    def fetch(name: str) -> torch.Tensor:
        if name == fail_at:
            raise OSError("injected failure mid-copy")
        return by_name[name]

    return fetch


def test_a_torn_mark_stays_until_that_tensor_is_written_again(model):
    """What a failed copy touched is torn; an empty chunk, an unrelated chunk and a relabel
    leave it torn (the refusals stay exactly those of a mix); writing it again clears it."""
    engine, updater = serve(model, weight_version="A")
    names = [
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
        "model.layers.1.mlp.up_proj.weight",
    ]
    named = [(n, hf_tensor(engine, n) + 1) for n in names]
    plan = lambda: apply.plan(model, apply.specs_of(named), require_full=False)  # noqa: E731
    with pytest.raises(WeightCopyError):
        updater.run(plan, failing_fetch(named, names[1]), weight_version="B")
    assert updater.versions.torn() == [names[0]]  # written before the failure; the rest untouched
    info = updater.versions.as_dict()
    assert info["weights_torn"] is True and info["torn_tensors"] == [names[0]]
    assert info["weights_mixed"] is False and info["label_counts"] == {"A": NUM_TENSORS}

    def refused() -> None:
        assert not engine.gate.is_consistent and "weights_inconsistent" in engine.ready_reasons()
        with pytest.raises(WeightsInconsistent) as err:
            engine.submit(req())
        assert err.value.status == 503 and names[0] in str(err.value)
        engine.pause("abort")
        with pytest.raises(WeightsInconsistentConflict) as err:
            engine.resume()
        assert err.value.status == 409 and engine.gate.is_paused  # still paused

    refused()
    push(updater, [], "v2")  # slime's empty alignment bucket, labelled
    refused()
    updater.set_version("v3")  # a relabel names the mix; it does not repair a torn tensor
    refused()
    push(updater, [(names[2], named[2][1])], "v3")  # another tensor: the torn one stays torn
    assert updater.versions.torn() == [names[0]]
    refused()
    push(updater, [(names[0], named[0][1])], None)  # that tensor written again, even unlabelled
    assert updater.versions.torn() == [] and engine.gate.is_consistent
    engine.resume()
    assert engine.submit(req())


def test_a_failed_checkpoint_copy_tears_every_tensor_it_changed(model, tmp_path):
    """A disk update read straight into the parameters on several threads, failing part-way:
    every HF tensor whose bytes changed carries the mark (and a full update clears them all)."""
    from grctl.weights import checkpoint as ckpt_mod
    from grctl.weights.checkpoint import Checkpoint
    from grctl.weights.disk import update_from_disk
    from grctl.weights.views import hf_state_dict

    engine, updater = serve(model, weight_version="A")
    before = {n: t.clone() for n, t in hf_state_dict(model).items()}
    path = tmp_path / "new"
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(model.config.to_hf()))
    save_file({n: t + 1 for n, t in before.items()}, str(path / "model.safetensors"))
    reads = {"n": 0}

    def fail_after_five(_: Checkpoint) -> None:
        reads["n"] += 1
        if reads["n"] > 5:
            raise OSError("injected read error")

    ckpt_mod.read_hooks.append(fail_after_five)
    try:
        with pytest.raises(WeightCopyError):
            update_from_disk(updater, str(path), weight_version="B")
    finally:
        ckpt_mod.read_hooks.remove(fail_after_five)
    changed = {n for n, t in hf_state_dict(model).items() if not torch.equal(t, before[n])}
    torn = set(updater.versions.torn())
    assert changed and changed <= torn and len(torn) < NUM_TENSORS
    assert "weights_inconsistent" in engine.ready_reasons()
    update_from_disk(updater, str(path), weight_version="B")
    assert updater.versions.torn() == [] and engine.gate.is_consistent


def test_torn_marks_are_per_hf_tensor_and_survive_relabels():
    versions = WeightVersions(DEFAULT_CONFIG, "A")
    versions.tear(["layers.0.self_attn.qkv_proj.weight"])  # a fused write may touch q, k and v
    q, k, v = (f"model.layers.0.self_attn.{m}_proj.weight" for m in "qkv")
    assert versions.torn() == sorted([q, k, v])
    versions.record([k], "B")
    versions.relabel("C")
    assert versions.torn() == sorted([q, v]) and "2 tensors" in versions.describe_torn()
    versions.record([], None, is_full=True)
    assert versions.torn() == [] and versions.describe_torn() is None
