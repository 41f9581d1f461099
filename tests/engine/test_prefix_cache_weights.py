"""The prefix cache under every weight write: no entry of other weights is ever used, every
write drops the entries with their bytes, and results after it equal transformers' on the new
weights and the uncached engine's."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.weights import apply
from grctl.weights.updater import WeightUpdater
from tests.support.reference import hf_and_ours, hf_generate

SHARED = tuple(range(10, 45))


def run(eng: Engine, prompt, n: int = 4):
    rid = eng.submit(GenerateRequest(tuple(prompt), SamplingParams(max_new_tokens=3, n=n)))
    while eng.run_step():
        pass
    return eng.result(rid)


def beams(result) -> list[list[int]]:
    return [b.output_ids for b in result.beams]


def scale_norm(updater: WeightUpdater, ours, hf, **kw) -> None:
    """One weight write through the updater (norm.weight x 1.5), the same on the HF model."""
    norm = ours.norm.weight.detach() * 1.5
    spec = apply.TensorSpec("norm.weight", tuple(norm.shape), norm.dtype)
    writes = apply.plan(ours, [spec], require_full=False)
    updater.run(lambda: writes, lambda _: norm, **kw)
    with torch.no_grad():
        hf.model.norm.weight.mul_(1.5)


def test_engine_never_serves_a_stale_entry_after_a_weight_change():
    hf, fresh = hf_and_ours(seed=5)
    eng = Engine(fresh, EngineConfig(enable_prefill_cache=True, weight_version="v1"))
    prompt = list(range(10, 30))
    before = run(eng, prompt)
    with eng.exclusive():  # new weights under a new version, and no flush
        fresh.norm.weight.mul_(1.5)
        eng.weights_written("v2", mix=None)
    after = run(eng, prompt)
    assert after.cached_tokens == 0 and after.weight_versions == ["v2"]
    assert after.beams[0].sequence_score != pytest.approx(before.beams[0].sequence_score, abs=1e-3)
    reference = Engine(fresh, EngineConfig(enable_prefill_cache=False))
    assert beams(run(reference, prompt)) == beams(after)
    st = eng.status()["prefill_cache"]
    assert (st["hits"], st["misses"], st["entries"]) == (0, 2, 1)


def test_an_update_without_flush_drops_old_entries_at_once():
    """Entries of the old weights hold KV memory and can never hit again: the update drops
    them itself (flush_cache=false keeps the counters, not the entries)."""
    hf, fresh = hf_and_ours(seed=5)
    eng = Engine(fresh, EngineConfig(enable_prefill_cache=True, weight_version="v1"))
    run(eng, list(range(10, 30)))
    run(eng, list(range(40, 50)))
    assert eng.status()["prefill_cache"]["entries"] == 2
    scale_norm(WeightUpdater(eng), fresh, hf, weight_version=None, flush_cache=False)
    st = eng.status()["prefill_cache"]
    assert (st["entries"], st["tokens"], st["inserts"], st["misses"]) == (0, 0, 2, 2)
    assert (st["bytes"], st["nodes"]) == (0, 0)


WRITES = {
    "update": {"weight_version": "v2", "flush_cache": False},
    "relabel-free update": {"weight_version": None, "flush_cache": False},
    "flush": {"weight_version": "v2", "flush_cache": True},
}


@pytest.mark.parametrize("kind", [*WRITES, "in_place pause", "relabel"])
def test_after_every_weight_write_a_shared_prefix_is_computed_again(kind):
    hf, ours = hf_and_ours(seed=5)
    # one tensor written under a new label: the weights are then mixed, served as asked
    cfg = EngineConfig(enable_prefill_cache=True, weight_version="v1", allow_partial_updates=True)
    eng = Engine(ours, cfg)
    updater = WeightUpdater(eng)
    first = run(eng, SHARED + (1, 2))
    assert first.cached_tokens == 0 and eng.status()["prefill_cache"]["bytes"] > 0
    if kind == "relabel":  # no write: the same KV, but another version's entries go unused
        updater.set_version("v2")
    elif kind == "in_place pause":  # frozen with its KV across the write, then goes on
        rid = eng.submit(GenerateRequest(SHARED + (3,), SamplingParams(max_new_tokens=3, n=4)))
        eng.run_step()
        eng.pause("in_place")
        scale_norm(updater, ours, hf, weight_version="v2", flush_cache=False)
        eng.resume()
        while eng.run_step():
            pass
        frozen = eng.result(rid)
        assert frozen.cached_tokens == len(SHARED) and frozen.weight_versions == ["v1", "v2"]
    else:
        scale_norm(updater, ours, hf, **WRITES[kind])
    if kind != "relabel":
        st = eng.status()["prefill_cache"]
        assert (st["entries"], st["nodes"], st["tokens"], st["bytes"]) == (0, 0, 0, 0)
    plain = Engine(ours, EngineConfig(enable_prefill_cache=False))
    for suffix, cached in (((4, 5), 0), ((6,), len(SHARED))):
        got, want = run(eng, SHARED + suffix), run(plain, SHARED + suffix)
        assert got.cached_tokens == cached and got.weight_versions == [eng.gate.label]
        assert beams(got) == beams(want)
        for a, b in zip(got.beams, want.beams, strict=True):
            assert a.sequence_score == pytest.approx(b.sequence_score, abs=1e-4)
    greedy = run(eng, SHARED + (7, 8), n=1)
    assert greedy.cached_tokens == len(SHARED)
    assert greedy.output_ids == hf_generate(hf, SHARED + (7, 8), 3)
    assert eng.cache.held_bytes() == eng.status()["prefill_cache"]["bytes"]
