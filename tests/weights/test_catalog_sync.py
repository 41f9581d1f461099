"""Weights and catalog as one sync, in process: an update that carries its catalog installs both
at one step boundary, labels the catalog with the weight version, and refuses the whole sync
when the catalog is bad; a fault at each step leaves either nothing changed or a server that
refuses to serve, saying why. Weights are checked against the checkpoint's own tensors and the
catalog against the file's items."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from grctl.catalog.store import CatalogStore
from grctl.engine import catalog_swap
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import (
    InternalError,
    Paused,
    ValidationError,
    WeightsInconsistent,
    WeightsInconsistentConflict,
    WeightsMixedConflict,
)
from grctl.weights import checkpoint
from grctl.weights import updater as updater_mod
from grctl.weights.disk import update_from_disk
from grctl.weights.loader import load_model
from grctl.weights.updater import WeightUpdater
from grctl.weights.views import hf_state_dict
from tests.support.checkpoints import load_hf, write_checkpoint

LEVELS = (range(20, 28), range(40, 56), range(60, 100))  # the tiny vocabulary's SID levels
PROMPT = (3, 1, 4, 1, 5)


def write_items(path: Path, seed: int, num: int = 40) -> set[tuple[int, ...]]:
    rng = random.Random(seed)
    rows = [[rng.choice(level) for level in LEVELS] for _ in range(num)]
    path.write_text(
        "".join(json.dumps({"item_id": i, "token_ids": r}) + "\n" for i, r in enumerate(rows))
    )
    return {tuple(r) for r in rows}


@pytest.fixture
def setup(tmp_path):
    a = write_checkpoint(tmp_path / "a", seed=51)
    b = write_checkpoint(tmp_path / "b", seed=52)
    engine = Engine(load_model(a), EngineConfig(weight_version="a", cuda_graph=False))
    engine.catalogs = CatalogStore(engine.device, engine.model.config.vocab_size)
    items_a, items_b = write_items(tmp_path / "a.jsonl", 1), write_items(tmp_path / "b.jsonl", 2)
    engine.catalogs.load(str(tmp_path / "a.jsonl"), weight_version="a")
    yield engine, WeightUpdater(engine), {"a": a, "b": b}, {"a": items_a, "b": items_b}, tmp_path
    engine.stop(drain=False)
    updater_mod.sync_hooks.clear()


def reasons(engine) -> list[str]:
    """Why generation is refused (stepped by hand: no worker is started)."""
    return [r for r in engine.ready_reasons() if r != "worker_not_running"]


def weights_equal(engine, ckpt: Path) -> bool:
    """Every served HF tensor equals the checkpoint's own."""
    theirs = load_hf(ckpt).state_dict()
    return all(
        torch.equal(view, theirs[name]) for name, view in hf_state_dict(engine.model).items()
    )


def item_of(engine) -> tuple[int, ...]:
    req = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3))
    rid = engine.submit(req)
    while engine.run_step():
        pass
    return tuple(engine.result(rid).output_ids)


def test_an_update_installs_its_catalog_with_its_weights(setup):
    engine, updater, ckpts, items, tmp = setup
    before = engine.catalogs.current
    assert item_of(engine) in items["a"]
    out = update_from_disk(
        updater, str(ckpts["b"]), weight_version="b", catalog_path=str(tmp / "b.jsonl")
    )
    cat = engine.catalogs.current
    assert out.catalog_version == cat.version == before.version + 1
    assert cat.weight_version == "b" and cat.source == str(tmp / "b.jsonl")
    assert weights_equal(engine, ckpts["b"])
    assert item_of(engine) in items["b"]
    status = engine.catalogs.status()
    assert status["weight_version"] == "b" and status["num_items"] == 40


def test_a_bad_catalog_refuses_the_whole_sync(setup):
    engine, updater, ckpts, items, tmp = setup
    before = engine.catalogs.current
    bad = tmp / "bad.jsonl"
    bad.write_text(
        '{"item_id": 1, "token_ids": [20, 40, 60]}\n{"item_id": 2, "token_ids": [9999]}\n'
    )
    with pytest.raises(ValidationError, match="line 2"):
        update_from_disk(updater, str(ckpts["b"]), weight_version="b", catalog_path=str(bad))
    assert engine.catalogs.current is before and engine.gate.label == "a"
    assert weights_equal(engine, ckpts["a"]) and reasons(engine) == []


@pytest.mark.parametrize("step", ["catalog_built", "weights_written"])
def test_a_fault_at_each_step(setup, step):
    engine, updater, ckpts, items, tmp = setup
    before = engine.catalogs.current

    def fault(at: str, _path: str) -> None:
        if at == step:
            raise RuntimeError(f"injected at {at}")

    updater_mod.sync_hooks.append(fault)
    path = str(tmp / "b.jsonl")
    if step == "catalog_built":  # before any weight: nothing changes
        with pytest.raises(RuntimeError):
            update_from_disk(updater, str(ckpts["b"]), weight_version="b", catalog_path=path)
        assert weights_equal(engine, ckpts["a"]) and engine.gate.label == "a"
        assert engine.catalogs.current is before and reasons(engine) == []
        return
    # after the weights: they are b's, the catalog a's, and nothing is served until it is b's
    with pytest.raises(InternalError, match="could not be installed") as err:
        update_from_disk(updater, str(ckpts["b"]), weight_version="b", catalog_path=path)
    assert "b.jsonl" in str(err.value) and weights_equal(engine, ckpts["b"])
    assert engine.catalogs.current is before
    assert reasons(engine) == ["catalog_inconsistent"]
    with pytest.raises(WeightsInconsistent, match="catalog that goes with"):
        engine.submit(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3)))
    engine.pause("abort")
    with pytest.raises(WeightsInconsistentConflict):
        engine.resume()
    updater_mod.sync_hooks.clear()
    catalog_swap.install(engine, engine.catalogs.build(path), with_weights=False)  # /catalog/reload
    engine.resume()
    assert reasons(engine) == [] and item_of(engine) in items["b"]
    assert engine.catalogs.current.weight_version == "b"


def test_a_failed_copy_leaves_the_catalog(setup):
    engine, updater, ckpts, items, tmp = setup
    before = engine.catalogs.current
    calls = []

    def read_error(ckpt) -> None:
        calls.append(1)
        if len(calls) > 2:
            raise OSError("injected read error")

    checkpoint.read_hooks.append(read_error)
    try:
        with pytest.raises(Exception, match="injected read error"):
            update_from_disk(
                updater, str(ckpts["b"]), weight_version="b", catalog_path=str(tmp / "b.jsonl")
            )
    finally:
        checkpoint.read_hooks.remove(read_error)
    assert engine.catalogs.current is before
    assert "weights_inconsistent" in reasons(engine)


def test_requests_in_flight_under_the_old_catalog_end_at_the_swap(setup):
    engine, updater, ckpts, items, tmp = setup
    constrained = engine.submit(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3)))
    free = engine.submit(
        GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3, use_catalog=False))
    )
    engine.run_step()  # both mid-request (two tokens each)
    engine.pause("in_place")
    out = update_from_disk(
        updater, str(ckpts["b"]), weight_version="b", catalog_path=str(tmp / "b.jsonl")
    )
    assert out.num_aborted_requests == 1
    engine.resume()
    while engine.run_step():
        pass
    assert engine.result(constrained).finish_reason == "abort"
    assert engine.result(free).finish_reason == "length"


def test_a_session_holds_everything_until_its_end_installs_both(setup):
    engine, updater, ckpts, items, tmp = setup
    updater.begin_session(catalog_path=str(tmp / "b.jsonl"))
    assert reasons(engine) == ["catalog_pending"]
    with pytest.raises(Paused, match="end_weight_update"):
        engine.submit(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3)))
    update_from_disk(updater, str(ckpts["b"]), weight_version="b")
    assert engine.catalogs.current.weight_version == "a"  # not yet
    assert "catalog version" in updater.end_session()
    assert reasons(engine) == [] and item_of(engine) in items["b"]
    assert engine.catalogs.current.weight_version == "b" and weights_equal(engine, ckpts["b"])


def test_a_session_ending_mixed_leaves_the_catalog_uninstalled_and_says_so(setup):
    engine, updater, ckpts, items, tmp = setup
    before = engine.catalogs.current
    updater.begin_session(catalog_path=str(tmp / "b.jsonl"))
    norm = load_hf(ckpts["b"]).model.norm.weight.detach()
    from grctl.weights import apply

    spec = apply.TensorSpec("model.norm.weight", tuple(norm.shape), norm.dtype)
    updater.run(lambda: apply.plan(engine.model, [spec], require_full=False), lambda _: norm,
                weight_version="b")  # fmt: skip
    with pytest.raises(WeightsMixedConflict):
        updater.end_session()
    assert engine.catalogs.current is before
    assert "catalog_inconsistent" in reasons(engine)


def test_a_bad_catalog_opens_no_session(setup):
    engine, updater, ckpts, items, tmp = setup
    with pytest.raises(ValidationError):
        updater.begin_session(catalog_path=str(tmp / "missing.jsonl"))
    assert reasons(engine) == []
    updater.begin_session()  # none is open
    updater.end_session()
