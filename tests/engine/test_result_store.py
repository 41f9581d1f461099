"""Unfetched results bounded by bytes (--max-finished-result-bytes): result_nbytes is within
the resident memory such results really take, the store drops the oldest while over either
bound (never the newest), its byte count follows every put and fetch, and a dropped result's
fetch is a 404 that says it was dropped."""

from __future__ import annotations

import gc
import os

import pytest

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import (
    BeamResult,
    GenerateRequest,
    GenerateResult,
    PromptLogprobs,
    SamplingParams,
)
from grctl.engine.results import ResultStore, result_nbytes
from grctl.errors import NotFound
from tests.support.reference import hf_and_ours


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scored(rid: str, tokens: int, k: int, seed: int) -> GenerateResult:
    """A prompt-scoring result as the engine builds one (tensors' .tolist(): a float and an int
    object per entry, token ids past the small-int cache)."""
    base = 1000 + seed
    top = [[(-(i + j) / 7.0 - seed, base + i * k + j) for j in range(k)] for i in range(tokens)]
    ids = [base + i for i in range(tokens)]
    prompt = PromptLogprobs(ids, [None] + [-i / 3.0 for i in range(1, tokens)], [None, *top[1:]])
    beam = BeamResult([base + 1], -1.5 - seed, "length", [-1.5 - seed])
    return GenerateResult(rid, tokens, [base + 1], "length", None, [beam], "v", ["v"], ["v"],
                          prompt_logprobs=prompt)  # fmt: skip


def test_the_estimate_is_the_resident_memory():
    gc.collect()
    before = rss()
    results = [scored(f"r{i}", 1000, 64, i) for i in range(4)]  # 256,000 (logprob, id) pairs
    grown = rss() - before
    estimate = sum(result_nbytes(r) for r in results)
    print(f"estimate {estimate / 2**20:.1f} MiB, RSS grew {grown / 2**20:.1f} MiB")
    assert 0.8 * grown <= estimate <= 1.25 * grown
    assert estimate >= 100 * 256_000  # ~116 bytes a pair, not 12


def test_the_oldest_are_dropped_past_the_byte_bound():
    made = [scored(f"r{i}", 100, 16, i) for i in range(4)]
    one = result_nbytes(made[0])
    assert {result_nbytes(r) for r in made} == {one}
    store = ResultStore(max_results=100, max_bytes=int(2.5 * one))
    for r in made:
        store.expect(r.request_id)
        store.put(r)
    assert [store.is_ready(f"r{i}") for i in range(4)] == [False, False, True, True]
    assert store.was_evicted("r0") and store.was_evicted("r1") and store.num_evicted == 2
    assert store.nbytes == 2 * one
    assert store.pop("r2") is made[2] and store.nbytes == one
    assert ResultStore(max_results=2).put(made[0]) is None  # no byte bound: count only
    huge = scored("big", 400, 16, 9)  # over the bound alone: kept, every other dropped
    store.put(huge)
    assert len(store) == 1 and store.peek("big") is huge and store.nbytes == result_nbytes(huge)
    store.pop("big")
    assert store.nbytes == 0 and len(store) == 0


def test_a_dropped_result_is_a_404_saying_so():
    _, model = hf_and_ours(seed=5)
    sp = SamplingParams(max_new_tokens=2)
    req = GenerateRequest(tuple(range(5, 45)), sp, return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=64)  # fmt: skip
    probe = Engine(model, EngineConfig())
    (rid,) = [probe.submit(req)]
    while probe.run_step():
        pass
    one = probe.status()["scheduler"]["retained_result_bytes"]
    assert one == result_nbytes(probe.result(rid)) > 40 * 64 * 100
    eng = Engine(model, EngineConfig(max_finished_result_bytes=one * 2 + one // 2))
    rids = [eng.submit(req) for _ in range(4)]
    while eng.run_step():
        pass
    status = eng.status()["scheduler"]
    assert status["retained_results"] == 2 and status["evicted_results"] == 2
    assert status["retained_result_bytes"] == 2 * one
    with pytest.raises(NotFound, match="dropped unfetched.*--max-finished-result-bytes"):
        eng.result(rids[0])
    with pytest.raises(NotFound, match="no request"):
        eng.poll("never-submitted")
    assert eng.result(rids[3]).prompt_logprobs.top[1]
