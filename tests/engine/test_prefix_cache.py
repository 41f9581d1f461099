"""The opt-in prefill cache: exact-prompt LRU, bounds, counters, and weight-version safety."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.kv_cache import ContextKV
from grctl.engine.prefix_cache import Entry, PrefillCache
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.weights import apply
from grctl.weights.updater import WeightUpdater
from tests.support.reference import hf_and_ours


def entry(num_tokens: int, version: str = "v1") -> Entry:
    kv = (torch.zeros(1, num_tokens, 2),)
    return Entry(version, ContextKV(kv, kv), torch.zeros(4))


def test_lru_bounded_by_entries_and_tokens():
    cache = PrefillCache(True, max_entries=2, max_tokens=100)
    cache.put((1,), entry(10))
    cache.put((2,), entry(10))
    assert cache.get((1,), "v1") is not None  # (1,) is now the most recent
    cache.put((3,), entry(10))
    assert cache.get((2,), "v1") is None and len(cache) == 2  # the least recent went
    cache.put((4,), entry(85))  # 105 tokens: the oldest goes until it fits
    assert cache.get((1,), "v1") is None and cache.get((3,), "v1") is not None
    cache.put((5,), entry(101))  # larger than the whole cache: not kept
    assert cache.get((5,), "v1") is None
    st = cache.stats()
    assert (st["entries"], st["tokens"], st["inserts"], st["evictions"]) == (2, 95, 4, 2)
    assert (st["hits"], st["misses"]) == (2, 3)
    assert cache.clear() == 2
    assert cache.stats() | {"max_entries": 0, "max_tokens": 0, "max_bytes": 0} == {
        "enabled": True,
        "entries": 0,
        "tokens": 0,
        "bytes": 0,
        "hits": 0,
        "misses": 0,
        "inserts": 0,
        "evictions": 0,
        "max_entries": 0,
        "max_tokens": 0,
        "max_bytes": 0,
    }


def test_lru_bounded_by_bytes():
    # entry(10): k and v of 10 tokens x 2 floats each (160 bytes) and 4 log-probs (16): 176
    cache = PrefillCache(True, max_entries=10, max_tokens=1000, max_bytes=400)
    cache.put((1,), entry(10))
    cache.put((2,), entry(10))
    assert cache.stats()["bytes"] == 352
    cache.put((3,), entry(10))  # 528 bytes: the oldest goes
    assert cache.get((1,), "v1") is None and len(cache) == 2
    cache.put((4,), entry(30))  # 496 bytes alone: never kept
    assert cache.get((4,), "v1") is None and cache.stats()["bytes"] == 352


def test_an_entry_of_another_version_is_never_used():
    cache = PrefillCache(True, max_entries=4, max_tokens=100)
    cache.put((1, 2), entry(2, "v1"))
    assert cache.get((1, 2), "v2") is None and len(cache) == 0  # dropped, not returned
    assert cache.get((1, 2), "v1") is None


def test_disabled_cache_keeps_nothing():
    cache = PrefillCache(False, max_entries=4, max_tokens=100)
    cache.put((1,), entry(1))
    assert cache.get((1,), "v1") is None and cache.stats()["misses"] == 0


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(seed=5)[1]


def run(eng: Engine, prompt, n: int = 4):
    rid = eng.submit(GenerateRequest(tuple(prompt), SamplingParams(max_new_tokens=3, n=n)))
    while eng.run_step():
        pass
    return eng.result(rid)


def test_engine_hit_gives_the_same_result(model):
    eng = Engine(model, EngineConfig(enable_prefill_cache=True))
    prompt = list(range(3, 40))
    first, second = run(eng, prompt), run(eng, prompt)
    assert first.cached_tokens == 0 and second.cached_tokens == len(prompt)
    assert [b.output_ids for b in first.beams] == [b.output_ids for b in second.beams]
    assert [b.sequence_score for b in first.beams] == [b.sequence_score for b in second.beams]
    st = eng.status()["prefill_cache"]
    assert (st["hits"], st["misses"], st["inserts"], st["entries"]) == (1, 1, 1, 1)
    assert eng.status()["scheduler"]["prefill_tokens"] == len(prompt)  # computed once
    assert eng.flush_cache() == (True, 1)
    assert eng.status()["prefill_cache"]["hits"] == 0
    assert run(eng, prompt).cached_tokens == 0


def test_engine_never_serves_a_stale_entry_after_a_weight_change(model):
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
    reference = Engine(fresh, EngineConfig())
    assert [b.output_ids for b in run(reference, prompt).beams] == [
        b.output_ids for b in after.beams
    ]
    st = eng.status()["prefill_cache"]
    assert (st["hits"], st["misses"], st["entries"]) == (0, 2, 1)


def test_an_update_without_flush_drops_old_entries_at_once(model):
    """Entries of the old weights hold KV memory and can never hit again: the update drops
    them itself (flush_cache=false keeps the counters, not the entries)."""
    hf, fresh = hf_and_ours(seed=5)
    eng = Engine(fresh, EngineConfig(enable_prefill_cache=True, weight_version="v1"))
    run(eng, list(range(10, 30)))
    run(eng, list(range(40, 50)))
    assert eng.status()["prefill_cache"]["entries"] == 2
    updater = WeightUpdater(eng)
    norm = fresh.norm.weight.detach() * 1.5
    writes = apply.plan(fresh, [apply.TensorSpec("norm.weight", tuple(norm.shape), norm.dtype)],
                        require_full=False)  # fmt: skip
    updater.run(lambda: writes, lambda _: norm, weight_version=None, flush_cache=False)
    st = eng.status()["prefill_cache"]
    assert (st["entries"], st["tokens"], st["inserts"], st["misses"]) == (0, 0, 2, 2)


def test_drop_entries_frees_their_bytes():
    """Every weight write drops the entries (drop_entries): their bytes go with them, or after a
    few updates without flush the cache holds nothing, reports its bound, and evicts every
    insert."""
    cache = PrefillCache(True, max_entries=10, max_tokens=1000, max_bytes=400)
    cache.put((1,), entry(10))
    cache.put((2,), entry(10))
    assert cache.drop_entries() == 2
    st = cache.stats()
    assert (st["entries"], st["tokens"], st["bytes"]) == (0, 0, 0)
    cache.put((3,), entry(10))
    cache.put((4,), entry(10))
    st = cache.stats()
    assert (st["entries"], st["bytes"], st["evictions"]) == (2, 352, 0)
    assert cache.get((3,), "v1") is not None
