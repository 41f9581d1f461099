"""The prefix cache: radix-tree reuse, bounds, counters, exact bytes, and weight-version safety;
the engine's results with it equal transformers' and its own without it."""

from __future__ import annotations

import random

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.kv_cache import ContextKV
from grctl.engine.model_runner import ModelRunner
from grctl.engine.prefix_cache import PrefixCache, join_kv
from grctl.engine.request import GenerateRequest, SamplingParams
from tests.support.reference import MAX_POS, ROPES, hf_and_ours, hf_generate, rope_pair

LP = torch.zeros(4)  # log-probabilities of a 4-token vocabulary: 16 bytes


def kv_of(prompt: tuple[int, ...]) -> ContextKV:
    """KV as a model's would be: token i's values depend on the tokens up to i only.
    One layer, one head, 2 dims: 16 bytes a token for k and v together."""
    sums = torch.tensor(prompt, dtype=torch.float64).cumsum(0) % 9973
    k = torch.stack([sums, torch.arange(len(prompt), dtype=torch.float64)], -1)[None].float()
    return ContextKV((k,), (-k,))


def prompt(first: int, n: int) -> tuple[int, ...]:
    return (first, *range(1000, 1000 + n - 1))


def put(cache: PrefixCache, p: tuple[int, ...], tag: str = "v1") -> None:
    cache.insert(p, kv_of(p), LP, tag)


def found(cache: PrefixCache, p: tuple[int, ...], tag: str = "v1") -> int:
    return cache.lookup(p, tag).num_tokens


def test_lru_bounded_by_entries_and_tokens():
    cache = PrefixCache(True, max_entries=2, max_tokens=100)
    p1, p2, p3, p4, p5 = (prompt(i, n) for i, n in ((1, 10), (2, 10), (3, 10), (4, 85), (5, 101)))
    put(cache, p1)
    put(cache, p2)
    assert found(cache, p1) == 10  # p1 is now the most recent
    put(cache, p3)
    assert found(cache, p2) == 0 and len(cache) == 2  # the least recent went
    put(cache, p4)  # 105 tokens: the oldest goes until it fits
    assert found(cache, p1) == 0 and found(cache, p3) == 10
    put(cache, p5)  # larger than the whole cache: not kept
    assert found(cache, p5) == 0
    st = cache.stats()
    assert (st["entries"], st["tokens"], st["inserts"], st["evictions"]) == (2, 95, 4, 2)
    assert (st["hits"], st["misses"], st["hit_tokens"]) == (2, 3, 20)
    assert cache.clear() == 2
    assert cache.stats() | {"max_entries": 0, "max_tokens": 0, "max_bytes": 0} == {
        "enabled": True,
        "entries": 0,
        "nodes": 0,
        "tokens": 0,
        "bytes": 0,
        "hits": 0,
        "misses": 0,
        "hit_tokens": 0,
        "inserts": 0,
        "evictions": 0,
        "max_entries": 0,
        "max_tokens": 0,
        "max_bytes": 0,
    }


def test_lru_bounded_by_bytes():
    # 10 tokens: k and v of 10 tokens x 2 floats each (160 bytes) and 4 log-probs (16): 176
    cache = PrefixCache(True, max_entries=10, max_tokens=1000, max_bytes=400)
    put(cache, prompt(1, 10))
    put(cache, prompt(2, 10))
    assert cache.stats()["bytes"] == 352
    put(cache, prompt(3, 10))  # 528 bytes: the oldest goes
    assert found(cache, prompt(1, 10)) == 0 and len(cache) == 2
    put(cache, prompt(4, 30))  # 496 bytes alone: never kept
    assert found(cache, prompt(4, 30)) == 0 and cache.stats()["bytes"] == 352


def test_an_entry_of_another_version_is_never_used():
    cache = PrefixCache(True, max_entries=4, max_tokens=100)
    put(cache, (1, 2), "v1")
    assert found(cache, (1, 2), "v2") == 0 and len(cache) == 0  # dropped, not returned
    assert cache.stats()["bytes"] == 0
    assert found(cache, (1, 2), "v1") == 0


def test_disabled_cache_keeps_nothing():
    cache = PrefixCache(False, max_entries=4, max_tokens=100)
    put(cache, (1,))
    assert found(cache, (1,)) == 0 and cache.stats()["misses"] == 0


def test_drop_entries_frees_their_bytes():
    """Every weight write drops the entries (drop_entries): their bytes go with them, or after a
    few updates without flush the cache holds nothing, reports its bound, and evicts every
    insert."""
    cache = PrefixCache(True, max_entries=10, max_tokens=1000, max_bytes=400)
    put(cache, prompt(1, 10))
    put(cache, prompt(2, 10))
    assert cache.drop_entries() == 2
    st = cache.stats()
    assert (st["entries"], st["tokens"], st["bytes"]) == (0, 0, 0)
    put(cache, prompt(3, 10))
    put(cache, prompt(4, 10))
    st = cache.stats()
    assert (st["entries"], st["bytes"], st["evictions"]) == (2, 352, 0)
    assert found(cache, prompt(3, 10)) == 10


def test_a_prompt_reuses_the_longest_cached_prefix():
    cache = PrefixCache(True, max_entries=10, max_tokens=1000)
    a = tuple(range(1, 21))
    put(cache, a)
    b = a[:12] + (99, 98)
    m = cache.lookup(b, "v1")
    assert m.num_tokens == 12 and m.logprobs is None
    assert torch.equal(join_kv(m.parts).k[0], kv_of(b).k[0][:, :12])
    # A prefix of a cached prompt, not itself cached: all but its last token, to compute it.
    m = cache.lookup(a[:12], "v1")
    assert m.num_tokens == 11 and m.logprobs is None
    m = cache.lookup(a, "v1")  # an exact repeat: every token, and its last log-probabilities
    assert m.num_tokens == 20 and torch.equal(m.logprobs, LP)
    assert cache.lookup(a + (5,), "v1").num_tokens == 20
    put(cache, b)  # splits a's node after 12 tokens; both halves and b's tail are entries' KV
    st = cache.stats()
    assert (st["entries"], st["nodes"], st["tokens"]) == (2, 3, 22)
    assert st["bytes"] == cache.held_bytes() == 22 * 16 + 2 * 16
    assert found(cache, a) == 20 and found(cache, b) == 14


def test_random_inserts_keep_kv_and_bytes_exact():
    """Prompts drawn from a few shared stems: every lookup's KV is the KV of the prompt's own
    first tokens, and `bytes` is what the nodes' storages hold, through splits and evictions."""
    rng = random.Random(3)
    stems = [tuple(rng.randrange(50) for _ in range(30)) for _ in range(3)]
    cache = PrefixCache(True, max_entries=12, max_tokens=400, max_bytes=8000)
    for _ in range(300):
        stem = rng.choice(stems)
        p = stem[: rng.randrange(1, 31)] + tuple(rng.randrange(50) for _ in range(rng.randrange(4)))
        if rng.random() < 0.5:
            put(cache, p)
        else:
            m = cache.lookup(p, "v1")
            if m.num_tokens:
                assert torch.equal(join_kv(m.parts).k[0], kv_of(p).k[0][:, : m.num_tokens])
                assert torch.equal(join_kv(m.parts).v[0], kv_of(p).v[0][:, : m.num_tokens])
            assert (m.logprobs is not None) == (m.num_tokens == len(p))
        st = cache.stats()
        assert st["bytes"] == cache.held_bytes()
        assert st["entries"] <= 12 and st["tokens"] <= 400 and st["bytes"] <= 8000
    assert cache.stats()["evictions"] > 0


def test_eviction_takes_least_recent_leaves_first():
    cache = PrefixCache(True, max_entries=10, max_tokens=39)
    a, b = tuple(range(20)), tuple(range(10)) + (77,) * 10  # share 10 tokens
    put(cache, a)
    put(cache, b)
    found(cache, a)  # b's leaf is now the least recent
    put(cache, (90,) * 10)  # 40 tokens: one leaf goes
    assert found(cache, a) == 20 and found(cache, b) == 10  # the shared part stayed


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=5)


def run(eng: Engine, prompts, n: int = 4, new: int = 3):
    rids = [
        eng.submit(GenerateRequest(tuple(p), SamplingParams(max_new_tokens=new, n=n)))
        for p in prompts
    ]
    while eng.run_step():
        pass
    return [eng.result(rid) for rid in rids]


def beams(result) -> list[list[int]]:
    return [b.output_ids for b in result.beams]


def test_engine_hit_gives_the_same_result(pair):
    eng = Engine(pair[1], EngineConfig(enable_prefill_cache=True))
    p = list(range(3, 40))
    (first,), (second,) = run(eng, [p]), run(eng, [p])
    # an exact repeat computes nothing, and reports all but its last token (SGLang's count)
    assert first.cached_tokens == 0 and second.cached_tokens == len(p) - 1
    assert beams(first) == beams(second)
    assert [b.sequence_score for b in first.beams] == [b.sequence_score for b in second.beams]
    st = eng.status()["prefill_cache"]
    assert (st["hits"], st["misses"], st["inserts"], st["entries"]) == (1, 1, 1, 1)
    assert eng.status()["scheduler"]["prefill_tokens"] == len(p)  # computed once
    assert eng.flush_cache() == (True, 1)
    assert eng.status()["prefill_cache"]["hits"] == 0
    assert run(eng, [p])[0].cached_tokens == 0


SHARED = tuple(range(3, 50))
SUFFIXES = [(100 + i, 7, 9 + i, 11) for i in range(4)]


def test_shared_prefix_equals_transformers_and_the_uncached_engine(pair):
    hf, ours = pair
    prompts = [SHARED + s for s in SUFFIXES]
    cached = Engine(ours, EngineConfig(enable_prefill_cache=True))
    plain = Engine(ours, EngineConfig(enable_prefill_cache=False))
    for p in prompts:  # one at a time: each after the first finds the shared prefix
        (got,), (want,) = run(cached, [p], n=1, new=4), run(plain, [p], n=1, new=4)
        assert got.output_ids == want.output_ids == hf_generate(hf, p, 4)
        assert got.beams[0].sequence_score == pytest.approx(want.beams[0].sequence_score, abs=1e-4)
    assert [r.cached_tokens for r in run(cached, [SHARED + (5,)], n=1)] == [len(SHARED)]
    got, want = run(cached, prompts + [SHARED[:20]], n=4), run(plain, prompts + [SHARED[:20]], n=4)
    assert [beams(r) for r in got] == [beams(r) for r in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.beams, w.beams, strict=True):
            assert a.sequence_score == pytest.approx(b.sequence_score, abs=1e-4)
    assert [r.cached_tokens for r in got] == [len(prompts[0]) - 1] * 4 + [19]  # repeats


def test_a_batch_sharing_a_prefix_computes_it_once(pair):
    eng = Engine(pair[1], EngineConfig(enable_prefill_cache=True))
    prompts = [SHARED + s for s in SUFFIXES] + [SHARED + SUFFIXES[0]]  # and one exact repeat
    results = run(eng, prompts)
    assert [r.cached_tokens for r in results] == [0] + [len(SHARED)] * 3 + [len(prompts[0]) - 1]
    sched = eng.status()["scheduler"]
    assert sched["prefill_tokens"] == len(prompts[0]) + 3 * len(SUFFIXES[0])
    assert sched["prefill_batches"] == 2  # the first prompt, then the three against its KV
    plain = run(Engine(pair[1], EngineConfig(enable_prefill_cache=False)), prompts)
    assert [beams(r) for r in results] == [beams(r) for r in plain]


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_suffix_prefill_against_a_cached_prefix_matches_transformers(kind):
    """Positions after the cached prefix, for every RoPE scaling; dynamic RoPE is reused only
    while no prompt runs past max_position_embeddings (its frequencies would change)."""
    hf, ours = rope_pair(kind, "rope_parameters")
    cfg = ours.config
    gen = torch.Generator().manual_seed(8)
    long = MAX_POS + 13 if kind != "dynamic" else MAX_POS
    prompts = [torch.randint(0, cfg.vocab_size, (long,), generator=gen) for _ in range(2)]
    prompts[1][:20] = prompts[0][:20]
    runner = ModelRunner(ours, torch.device("cpu"))
    (ctx,), _ = runner.prefill([prompts[0][:20]])
    ctxs, logprobs = runner.prefill([prompts[1][20:], prompts[0]], [[ctx], []])
    with torch.no_grad():
        for p, c, lp in zip([prompts[1], prompts[0]], ctxs, logprobs, strict=True):
            out = hf(p[None], use_cache=True)
            want = torch.log_softmax(out.logits[0, -1].float(), -1)
            assert (lp - want).abs().max() < 1e-4, kind
            hf_k = out.past_key_values.layers[0].keys[0]  # [KV, len, D]
            assert c.length == len(p) and (join_kv(c.parts).k[0] - hf_k).abs().max() < 1e-4
            assert c.prefix is None or c.prefix.k[0].data_ptr() == ctx.k[0].data_ptr()
    if kind == "dynamic":
        eng = Engine(ours, EngineConfig(enable_prefill_cache=True, max_context_len=96))
        past = [tuple(prompts[0].tolist()) + (1,) * 5, tuple(prompts[0].tolist()) + (2,) * 5]
        results = run(eng, past, n=1)
        assert [r.cached_tokens for r in results] == [0, 0]
        assert [r.output_ids for r in results] == [hf_generate(hf, p, 3) for p in past]


def test_requests_continuing_a_cached_prefix_read_it_in_place(pair, monkeypatch):
    """Requests whose prompts continue a cached prompt hold its node's KV by reference as their
    context's prefix (their prefill copies none of it), and a decode step reads it once per
    layer for all of them."""
    from grctl.model import attention

    eng = Engine(pair[1], EngineConfig(enable_prefill_cache=True))
    run(eng, [SHARED + (1, 2)])
    for s in SUFFIXES:
        eng.submit(GenerateRequest(SHARED + s, SamplingParams(max_new_tokens=3, n=2)))
    eng.run_step()  # the four prefills (against the cached prefix) and their first token
    seqs = list(eng.scheduler.running)
    assert [s.cached_tokens for s in seqs] == [len(SHARED)] * 4
    node = seqs[0].ctx.prefix
    layers = pair[1].config.num_layers
    for s in seqs:
        assert s.ctx.prefix.length == len(SHARED) and s.ctx.own_length == len(SUFFIXES[0])
        for layer in range(layers):
            assert s.ctx.prefix.k[layer].data_ptr() == node.k[layer].data_ptr()
    reads = []
    real = attention.attention_with_lse

    def spy(q, k, v):
        reads.append(k.data_ptr())
        return real(q, k, v)

    monkeypatch.setattr(attention, "attention_with_lse", spy)
    eng.run_step()  # a decode step of the four
    assert [reads.count(node.k[layer].data_ptr()) for layer in range(layers)] == [1] * layers
    assert len(reads) == 5 * layers  # the shared prefix, then each request's own part
    while eng.run_step():
        pass


@pytest.mark.gpu
def test_cuda_shared_prefix_equals_the_uncached_engine():
    """On CUDA, through captured decode graphs: requests continuing a cached prefix give the
    uncached engine's beams and scores."""
    ours = hf_and_ours(seed=5, device="cuda")[1]
    prompts = [SHARED + s for s in SUFFIXES]
    cached = Engine(ours, EngineConfig(device="cuda", enable_prefill_cache=True))
    plain = Engine(ours, EngineConfig(device="cuda", enable_prefill_cache=False))
    run(cached, prompts[:1])
    got, want = run(cached, prompts), run(plain, prompts)
    assert [r.cached_tokens for r in got] == [len(prompts[0]) - 1] + [len(SHARED)] * 3
    assert [beams(r) for r in got] == [beams(r) for r in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.beams, w.beams, strict=True):
            assert a.sequence_score == pytest.approx(b.sequence_score, abs=1e-3)
