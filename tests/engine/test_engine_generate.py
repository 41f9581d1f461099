"""Generation semantics against transformers' own generate() on the same tiny random weights."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from tests.support.reference import hf_and_ours, hf_generate

VOCAB = 128


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=7)


@pytest.fixture()
def engine(pair):
    eng = Engine(pair[1], EngineConfig(max_beam_width=32))
    eng.start()
    yield eng
    eng.stop(drain=False)


def prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(
        torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    )


def req(ids, **sampling) -> GenerateRequest:
    logprob = sampling.pop("return_logprob", False)
    return GenerateRequest(ids, SamplingParams(**sampling), return_logprob=logprob)


@pytest.mark.parametrize("length", [1, 5, 40])
def test_greedy_equals_transformers(pair, engine, length):
    ids = prompt(length, length)
    res = engine.generate(req(ids, max_new_tokens=8, return_logprob=True))
    assert res.output_ids == hf_generate(pair[0], ids, 8)
    assert res.finish_reason == "length" and res.matched_stop is None
    # per-token logprobs are transformers' log_softmax at each chosen token
    with torch.no_grad():
        logits = pair[0](torch.tensor([ids + tuple(res.output_ids)])).logits[0].float()
    lp = torch.log_softmax(logits[len(ids) - 1 : -1], -1)
    ref = lp[torch.arange(8), torch.tensor(res.output_ids)]
    assert torch.allclose(torch.tensor(res.output_token_logprobs), ref, atol=1e-4)
    assert res.beams[0].sequence_score == pytest.approx(ref.sum().item(), abs=1e-4)


@pytest.mark.parametrize(("width", "new_tokens", "length"), [(4, 3, 17), (4, 3, 1), (8, 4, 33)])
def test_beam_search_equals_transformers(pair, engine, width, new_tokens, length):
    ids = prompt(length, 100 + length)
    res = engine.generate(req(ids, max_new_tokens=new_tokens, n=width, return_logprob=True))
    out = pair[0].generate(
        torch.tensor([ids]),
        max_new_tokens=new_tokens,
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        length_penalty=0.0,  # sequences_scores are then raw cumulative logprobs
        early_stopping=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    hf_seqs = out.sequences[:, length:].tolist()
    assert [b.output_ids for b in res.beams] == hf_seqs
    assert res.output_ids == hf_seqs[0]
    scores = torch.tensor([b.sequence_score for b in res.beams])
    assert torch.allclose(scores, out.sequences_scores.float(), atol=1e-4)
    assert all(b.finish_reason == "length" for b in res.beams)
    assert sum(res.output_token_logprobs) == pytest.approx(res.beams[0].sequence_score, abs=1e-4)


def test_stop_token_ends_greedy_like_transformers_eos(pair, engine):
    ids = prompt(12, 5)
    full = engine.generate(req(ids, max_new_tokens=8)).output_ids
    cut = next(i for i in range(1, 8) if full[i] not in full[:i])
    stop = full[cut]
    res = engine.generate(req(ids, max_new_tokens=8, stop_token_ids=(stop,)))
    assert res.output_ids == full[: cut + 1] == hf_generate(pair[0], ids, 8, eos_token_id=stop)
    assert res.finish_reason == "stop" and res.matched_stop == stop
    ignored = engine.generate(req(ids, max_new_tokens=8, stop_token_ids=(stop,), ignore_eos=True))
    assert ignored.output_ids == full and ignored.finish_reason == "length"


def test_beams_finish_on_stop_token(engine):
    ids = prompt(20, 9)
    free = engine.generate(req(ids, max_new_tokens=3, n=6))
    stop = free.beams[1].output_ids[1]  # a token some beam emits at step 2
    res = engine.generate(req(ids, max_new_tokens=3, n=6, stop_token_ids=(stop,)))
    scores = [b.sequence_score for b in res.beams]
    assert scores == sorted(scores, reverse=True) and len(res.beams) == 6
    stopped = [b for b in res.beams if b.finish_reason == "stop"]
    assert stopped and all(b.output_ids[-1] == stop and len(b.output_ids) < 4 for b in stopped)
    for b in res.beams:
        assert stop not in b.output_ids[:-1]
        assert b.finish_reason == "stop" or len(b.output_ids) == 3


def test_max_new_tokens_one_uses_prefill_only(pair, engine):
    ids = prompt(30, 11)
    res = engine.generate(req(ids, max_new_tokens=1, n=5))
    with torch.no_grad():
        lp = torch.log_softmax(pair[0](torch.tensor([ids])).logits[0, -1].float(), -1)
    top = lp.topk(5)
    assert [b.output_ids for b in res.beams] == [[t] for t in top.indices.tolist()]
    assert torch.allclose(
        torch.tensor([b.sequence_score for b in res.beams]), top.values, atol=1e-4
    )


def test_sampling_is_seeded_and_reproducible(engine):
    ids = prompt(10, 3)
    kw = dict(max_new_tokens=12, temperature=1.5, top_p=0.95, top_k=50)
    a = engine.generate(req(ids, seed=1234, **kw)).output_ids
    b = engine.generate(req(ids, seed=1234, **kw)).output_ids
    others = {tuple(engine.generate(req(ids, seed=s, **kw)).output_ids) for s in range(5)}
    assert a == b and len(others) > 1
    greedy = engine.generate(req(ids, max_new_tokens=12)).output_ids
    assert (
        engine.generate(req(ids, max_new_tokens=12, temperature=1.0, top_k=1, seed=5)).output_ids
        == greedy
    )
    assert (
        engine.generate(req(ids, max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=6)).output_ids
        == greedy
    )


def test_mixed_batch_equals_each_alone(pair):
    """16 requests (prompt lengths 1-90, widths 1-16, sampled ones seeded) submitted together.

    A small prefill budget admits them over several steps, so prefills and decodes mix."""
    reqs = []
    for i in range(16):
        n = [1, 2, 4, 16][i % 4]
        sampling = dict(max_new_tokens=2 + i % 4, n=n)
        if n == 1 and i % 8 == 0:
            sampling.update(temperature=0.8, seed=i)
        reqs.append(req(prompt(1 + (i * 37) % 90, 200 + i), **sampling))
    eng = Engine(pair[1], EngineConfig(prefill_token_budget=128, max_running_requests=6))
    ids = [eng.submit(r) for r in reqs]  # queued before the worker starts: one wave
    eng.start()
    together = [eng.result(i, timeout=60) for i in ids]
    assert eng.status()["scheduler"]["prefill_batches"] > 1
    alone = [eng.generate(r, timeout=60) for r in reqs]
    eng.stop()
    for t, a in zip(together, alone, strict=True):
        assert [b.output_ids for b in t.beams] == [b.output_ids for b in a.beams]
        for bt, ba in zip(t.beams, a.beams, strict=True):
            assert bt.sequence_score == pytest.approx(ba.sequence_score, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_engine(dtype):
    hf, ours = hf_and_ours(seed=7, dtype=dtype)
    eng = Engine(ours, EngineConfig())
    ids = prompt(24, 1)
    rid = eng.submit(req(ids, max_new_tokens=3, n=4))
    while eng.run_step():
        pass
    beams = eng.result(rid).beams
    assert len(beams) == 4 and all(len(b.output_ids) == 3 for b in beams)
    scores = [b.sequence_score for b in beams]
    assert scores == sorted(scores, reverse=True) and all(s == s and s < 0 for s in scores)
    assert eng.status()["engine"]["dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize(("width", "seed"), [(3, 9), (6, 21), (12, 4)])
def test_beam_search_with_stop_token_equals_transformers(pair, engine, width, seed):
    """Finished beams as transformers keeps them: n running beams beside a pool of n finished,
    a beam that ends joins the pool only if it ranks in the first n candidates."""
    ids = prompt(20, seed)
    free = engine.generate(req(ids, max_new_tokens=4, n=width))
    stop = free.beams[1].output_ids[1]  # a token some beam emits at step 2
    res = engine.generate(req(ids, max_new_tokens=4, n=width, stop_token_ids=(stop,)))
    out = pair[0].generate(
        torch.tensor([ids]),
        max_new_tokens=4,
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        length_penalty=0.0,
        early_stopping=False,
        eos_token_id=stop,
        pad_token_id=stop,
        output_scores=True,
        return_dict_in_generate=True,
    )
    lengths = (out.beam_indices >= 0).sum(1).tolist()
    hf_seqs = [
        s[len(ids) : len(ids) + n] for s, n in zip(out.sequences.tolist(), lengths, strict=True)
    ]
    assert [b.output_ids for b in res.beams] == hf_seqs
    scores = torch.tensor([b.sequence_score for b in res.beams])
    assert torch.allclose(scores, out.sequences_scores.float(), atol=1e-4)
    assert any(b.finish_reason == "stop" for b in res.beams)
    for b in res.beams:
        assert (b.finish_reason == "stop") == (b.output_ids[-1] == stop)
