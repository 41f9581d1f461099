"""The WeightUpdater over a real engine, in process: cache tagging, failed copies, relabels."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import MemoryReleased, WeightsInconsistent
from grctl.weights import apply
from grctl.weights.apply import WeightCopyError
from grctl.weights.checkpoint import Checkpoint, plan_checkpoint
from grctl.weights.disk import update_from_disk
from grctl.weights.loader import load_model
from grctl.weights.updater import WeightUpdater
from tests.support.checkpoints import write_checkpoint
from tests.support.reference import hf_generate

PROMPT = (5, 9, 33, 2, 71, 8)


@pytest.fixture
def setup(tmp_path):
    a = write_checkpoint(tmp_path / "a", seed=31)
    b = write_checkpoint(tmp_path / "b", seed=32)
    engine = Engine(load_model(a), EngineConfig(enable_prefill_cache=True, cuda_graph=False))
    engine.start()
    yield engine, WeightUpdater(engine), a, b
    engine.stop(drain=False)


def greedy(engine) -> list[int]:
    req = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4))
    return engine.generate(req, timeout=60).output_ids


def test_cache_never_serves_kv_of_replaced_weights_even_without_flush(setup):
    engine, updater, a, b = setup
    assert greedy(engine) == hf_generate(a, list(PROMPT))
    assert greedy(engine) == hf_generate(a, list(PROMPT))  # a cache hit, same weights
    hits = engine.cache.stats()["hits"]
    assert hits >= 1
    # Same version label, no flush: the cached KV of `a` must not be used for `b`.
    update_from_disk(updater, str(b), weight_version=None, flush_cache=False)
    stats = engine.cache.stats()  # not flushed: the counters stay, the stale entries are gone
    assert stats["entries"] == 0 and stats["hits"] == hits and stats["inserts"] >= 1
    assert greedy(engine) == hf_generate(b, list(PROMPT))
    assert engine.cache.stats()["hits"] == hits


def test_flush_on_update_clears_cache_and_counters(setup):
    engine, updater, a, b = setup
    greedy(engine)
    greedy(engine)
    out = update_from_disk(updater, str(b), weight_version="b", flush_cache=True)
    stats = engine.cache.stats()
    assert out.flushed_cache and stats["entries"] == 0
    assert stats["hits"] == stats["misses"] == stats["inserts"] == 0
    assert updater.versions.current == "b" and updater.versions.update_count == 1


def test_copy_failure_refuses_generation_until_a_good_update(setup):
    engine, updater, a, b = setup
    ckpt = Checkpoint(b)
    calls = {"n": 0}

    def failing_fetch(name: str) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("injected read error")
        return ckpt.fetch(name)

    with pytest.raises(WeightCopyError, match="after 4 of"):
        updater.run(
            lambda: plan_checkpoint(engine.model, ckpt), failing_fetch, weight_version="half"
        )
    assert "weights_inconsistent" in engine.ready_reasons()
    with pytest.raises(WeightsInconsistent):
        engine.submit(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=1)))
    assert updater.versions.current == "default" and updater.versions.update_count == 0
    update_from_disk(updater, str(a), weight_version="a")
    assert "weights_inconsistent" not in engine.ready_reasons()
    assert greedy(engine) == hf_generate(a, list(PROMPT))


def test_validation_failure_changes_nothing_and_counts_nothing(setup):
    engine, updater, a, _ = setup
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    bad = [("model.norm.weight", torch.zeros(3))]
    with pytest.raises(Exception, match="has shape"):
        updater.run(
            lambda: apply.plan(engine.model, apply.specs_of(bad), require_full=False),
            dict(bad).__getitem__,
            weight_version="x",
        )
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n])
    assert updater.versions.update_count == 0 and engine.gate.label == "default"
    assert greedy(engine) == hf_generate(a, list(PROMPT))


def test_release_updates_and_reads_take_turns(setup, monkeypatch):
    """The CUDA offload branch (a host copy of each parameter, then its storage freed) run on
    the CPU, slowly: an update and a read that arrive mid-release wait for it to end and are
    then refused (503 memory_released). Before, the update wrote into parameters already backed
    up, and resume brought back the old values under the new label."""
    from grctl.engine import memory
    from grctl.weights.views import read_rows

    engine, updater, a, b = setup
    engine.pause("abort")
    begun = threading.Event()

    def slow_host_copy(p):
        begun.set()
        time.sleep(0.02)
        backup = torch.empty(p.shape, dtype=p.dtype)
        backup.copy_(p.detach())
        return backup

    monkeypatch.setattr(memory, "host_backup", slow_host_copy)
    engine.memory.is_backup_all = True  # --enable-weights-cpu-backup: the host-copy branch
    release = threading.Thread(target=engine.release_memory, args=(["weights"],))
    release.start()
    assert begun.wait(10)
    with pytest.raises(MemoryReleased):
        update_from_disk(updater, str(b), weight_version="b")
    with pytest.raises(MemoryReleased):
        updater.read(read_rows, engine.model, "model.norm.weight", 1)
    release.join(30)
    assert engine.memory.released == frozenset({"weights"})
    engine.resume_memory(["weights"])
    engine.resume()
    assert updater.versions.current == "default" and engine.gate.label == "default"
    assert greedy(engine) == hf_generate(a, list(PROMPT))  # the label's weights: a's
