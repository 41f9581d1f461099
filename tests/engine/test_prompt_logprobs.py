"""Prompt scoring (logprob_start_len) in the engine, against transformers' own forward: SGLang's
shape (the first entry has no logprob), alone and packed beside other requests, with a
continuation generated after it, chunked, through the prefix cache, and the bounds."""

from __future__ import annotations

import pytest
import torch

from grctl.engine import prompt_logprobs
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import ValidationError
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

VOCAB = 128


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=11)


@pytest.fixture()
def engine(pair):
    return Engine(pair[1], EngineConfig())


def prompt(n: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (n,), generator=gen).tolist())


def scoring(ids, start: int, top: int = 0, **sampling) -> GenerateRequest:
    sampling.setdefault("max_new_tokens", 0)
    return GenerateRequest(
        tuple(ids),
        SamplingParams(**sampling),
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=top,
    )


@torch.no_grad()
def hf_prompt_logprobs(hf, ids) -> torch.Tensor:
    """[len(ids), vocab]: row j is the log-distribution of token j given tokens < j (row 0 is
    unused)."""
    logits = hf(torch.tensor([list(ids)])).logits[0].float()
    return torch.cat((torch.zeros(1, logits.shape[-1]), torch.log_softmax(logits[:-1], -1)))


def check(hf, ids, start, scores, top: int = 0):
    """The reply's entries equal transformers' log-probabilities within 1e-5."""
    ref = hf_prompt_logprobs(hf, ids)
    assert scores.token_ids == list(ids[start:])
    assert scores.logprobs[0] is None
    got = torch.tensor(scores.logprobs[1:], dtype=torch.float32)
    pos = torch.arange(start + 1, len(ids))
    want = ref[pos, torch.tensor(ids[start + 1 :], dtype=torch.long)]
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    if top:
        assert scores.top[0] is None and len(scores.top) == len(ids) - start
        for row, j in zip(scores.top[1:], pos.tolist(), strict=True):
            vals, idx = ref[j].topk(top)
            assert [t for _, t in row] == idx.tolist()
            assert torch.allclose(torch.tensor([v for v, _ in row]), vals, atol=1e-5, rtol=0)
    else:
        assert scores.top is None


@pytest.mark.parametrize("start", [0, 1, 7, 19])
def test_prompt_only_scores_equal_transformers(pair, engine, start):
    ids = prompt(20, start)
    (res,) = run_requests(engine, [scoring(ids, start, top=5)])
    assert res.finish_reason == "length" and res.output_ids == [] and res.beams == []
    assert res.output_token_logprobs == []
    check(pair[0], ids, start, res.prompt_logprobs, top=5)


def test_start_at_the_prompt_end_or_unset_scores_nothing(engine):
    ids = prompt(6, 1)
    plain = GenerateRequest(ids, SamplingParams(max_new_tokens=0), return_logprob=True)
    res = run_requests(engine, [scoring(ids, len(ids)), plain])
    assert [r.prompt_logprobs for r in res] == [None, None]
    assert [r.finish_reason for r in res] == ["length", "length"]


def test_scored_prompts_packed_beside_other_requests(pair, engine):
    """One prefill holds scored prompts of several lengths and starts, and generating ones:
    each gets its own scores, and the generating ones what they get alone."""
    gen = [
        GenerateRequest(prompt(n, 50 + n), SamplingParams(max_new_tokens=3, n=2)) for n in (9, 30)
    ]
    alone = [run_requests(Engine(pair[1], EngineConfig()), [r])[0] for r in gen]
    scored = [(prompt(n, n), s) for n, s in ((12, 0), (33, 5), (4, 3), (25, 24))]
    reqs = [gen[0], *(scoring(ids, s, top=3) for ids, s in scored), gen[1]]
    res = run_requests(engine, reqs)
    assert engine.executor.num_prefill_batches == 1
    for (ids, s), r in zip(scored, res[1:-1], strict=True):
        check(pair[0], ids, s, r.prompt_logprobs, top=3)
    for want, got in zip(alone, (res[0], res[-1]), strict=True):
        assert [b.output_ids for b in got.beams] == [b.output_ids for b in want.beams]
        assert got.prompt_logprobs is None


def test_prompt_and_continuation_generate_as_usual(pair, engine):
    """Scored and generating: the continuation is the one the unscored request gets."""
    ids = prompt(15, 3)
    want = run_requests(engine, [GenerateRequest(ids, SamplingParams(max_new_tokens=4))])[0]
    engine.cache.clear()
    (res,) = run_requests(engine, [scoring(ids, 2, max_new_tokens=4)])
    assert res.output_ids == want.output_ids and res.finish_reason == "length"
    check(pair[0], ids, 2, res.prompt_logprobs)


def test_logits_are_computed_in_chunks(pair, engine, monkeypatch):
    """A chunk of a few rows at a time gives the same scores (the bound that keeps a long
    prompt's [tokens, vocab] logits from being held whole)."""
    monkeypatch.setattr(prompt_logprobs, "CHUNK_ELEMENTS", 3 * VOCAB)
    seen = []
    real = pair[1].logits
    monkeypatch.setattr(pair[1], "logits", lambda h: seen.append(h.shape[0]) or real(h))
    ids = prompt(40, 9)
    (res,) = run_requests(engine, [scoring(ids, 0, top=2)])
    assert max(seen) <= 3 and sum(seen) == 39 + 1  # the scored rows, then the last token's
    check(pair[0], ids, 0, res.prompt_logprobs, top=2)


def test_candidates_after_one_prompt_share_its_kv(pair, engine):
    """Score many items for one user: prompt + candidate, logprob_start_len = len(prompt) - 1,
    every candidate after the first continues the prompt's cached KV (cached_tokens), and the
    scores are transformers' whether cached or not."""
    user = prompt(40, 77)
    items = [prompt(3, 100 + i) for i in range(6)]
    start = len(user) - 1
    res = run_requests(engine, [scoring(user + item, start) for item in items])
    cached = [r.cached_tokens for r in res]
    assert cached[0] == 0 and all(c >= 32 for c in cached[1:]), cached
    assert all(c <= start for c in cached)
    for item, r in zip(items, res, strict=True):
        check(pair[0], user + item, start, r.prompt_logprobs)
    later = run_requests(engine, [scoring(user + items[0], start)])[0]
    assert later.cached_tokens == start  # at most the tokens before the scored ones
    check(pair[0], user + items[0], start, later.prompt_logprobs)
    stats = engine.cache.stats()
    assert stats["hits"] >= len(items) and stats["hit_tokens"] == sum(cached) + start


def test_refusals(pair):
    eng = Engine(pair[1], EngineConfig())
    ids = prompt(10, 2)
    for start in (11, -2, 1.5, True):
        with pytest.raises(ValidationError, match="logprob_start_len"):
            eng.submit(scoring(ids, start))
    huge = scoring(prompt(400, 4), 0, top=VOCAB)
    assert prompt_logprobs.num_entries(huge) == 399 * (VOCAB + 1)
    eng.submit(huge)  # within the bound


def test_too_many_entries_is_a_400_not_an_oom(pair, monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "MAX_ENTRIES", 1000)
    eng = Engine(pair[1], EngineConfig())
    with pytest.raises(ValidationError, match="more than 1000"):
        eng.submit(scoring(prompt(100, 4), 0, top=10))
    eng.submit(scoring(prompt(100, 4), 0, top=9))  # 99 x 10 = 990


def test_scores_count_in_the_memory_budget(pair):
    """--max-kv-bytes: a prompt that fits to generate from can be too big to score whole."""
    ids = prompt(300, 6)
    probe = Engine(pair[1], EngineConfig())
    plain = GenerateRequest(ids, SamplingParams(max_new_tokens=0), return_logprob=True)
    need = probe.kv_bytes_of(plain)
    assert probe.kv_bytes_of(scoring(ids, 0)) > need
    eng = Engine(pair[1], EngineConfig(max_kv_bytes=need))
    eng.submit(plain)
    with pytest.raises(ValidationError, match="max-kv-bytes"):
        eng.submit(scoring(ids, 0))
