"""Top log-probabilities within the memory budget: only the requests that ask keep them (a
request that does not ask, beside one that does, keeps no [rows, k] rows), what they keep counts
in --max-kv-bytes and is bounded per request, and each is transformers' own top-k of the beam's
prefix."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.kv_cache import top_logprobs_bytes
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.engine.search.row_tops import RowTops
from grctl.engine.sequence import Sequence
from grctl.engine.validation import MAX_TOP_LOGPROB_ENTRIES
from grctl.errors import ValidationError
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

NEW = 3
PROMPT = tuple(range(5, 25))


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=9)


def ask(width: int, k: int, prompt=PROMPT) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=NEW, n=width, ignore_eos=True)
    return GenerateRequest(prompt, sp, return_logprob=k > 0, top_logprobs_num=k)


@torch.no_grad()
def hf_top(hf, prompt, ids, k):
    logits = hf(torch.tensor([list(prompt) + ids])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).topk(k, -1)


def test_only_the_requests_that_ask_hold_top_logprobs(pair):
    hf, model = pair
    eng = Engine(model, EngineConfig())
    reqs = [ask(2, 3), ask(8, 0, PROMPT[:12]), ask(1, 5, PROMPT[:15])]
    rids = [eng.submit(r) for r in reqs]
    eng.run_step()  # the prefill, the first tokens and one decode step of all three
    seqs = [eng.scheduler.get(r) for r in rids]
    state = seqs[0].beams.state
    assert all(s.beams.state is state for s in seqs)  # one step state for the three
    firsts = state.top_first_rows
    assert firsts[seqs[1].beams.row] == -1  # the one that does not ask keeps nothing
    assert state.rows_top[0].shape == (2 + 1, 5)  # the rows of the two that ask, k of the larger
    assert sorted(firsts[s.beams.row] for s in (seqs[0], seqs[2])) == [0, 2]
    while eng.run_step():
        pass
    results = [eng.result(r) for r in rids]
    assert results[1].beams[0].output_top_logprobs is None
    for req, res in ((reqs[0], results[0]), (reqs[2], results[2])):
        alone = run_requests(Engine(model, EngineConfig()), [req])[0]
        for beam, solo in zip(res.beams, alone.beams, strict=True):
            assert beam.output_ids == solo.output_ids
            alone_ids = [[t for _, t in row] for row in solo.output_top_logprobs]
            assert [[t for _, t in row] for row in beam.output_top_logprobs] == alone_ids
            want = hf_top(hf, req.input_ids, beam.output_ids, req.top_logprobs_num)
            tops = beam.output_top_logprobs
            assert [[t for _, t in row] for row in tops] == want.indices.tolist()
            got = [lp for row in tops for lp, _ in row]
            assert got == pytest.approx(want.values.flatten().tolist(), abs=1e-4)


def test_top_logprobs_count_in_the_kv_budget(pair):
    _, model = pair
    probe = Engine(model, EngineConfig())
    plain, asking = ask(4, 0), ask(4, 64)
    extra = probe.kv_bytes_of(asking) - probe.kv_bytes_of(plain)
    assert extra == top_logprobs_bytes(4, NEW, 64) == 12 * 4 * 64 * NEW
    eng = Engine(model, EngineConfig(max_kv_bytes=probe.kv_bytes_of(plain) + extra // 2))
    eng.submit(plain)
    with pytest.raises(ValidationError, match="KV budget"):
        eng.submit(asking)
    assert eng.status()["scheduler"]["kv_bytes_admitted"] == 0  # nothing admitted yet


def test_top_logprobs_are_bounded_per_request(pair):
    _, model = pair
    eng = Engine(model, EngineConfig(max_new_tokens=400, max_beam_width=128))
    vocab = model.config.vocab_size
    sp = SamplingParams(max_new_tokens=400, n=128, ignore_eos=True)
    huge = GenerateRequest(PROMPT, sp, return_logprob=True, top_logprobs_num=vocab)
    assert vocab * 128 * 400 > MAX_TOP_LOGPROB_ENTRIES
    with pytest.raises(ValidationError, match="top_logprobs_num"):
        eng.submit(huge)


@pytest.mark.parametrize(
    "width, new",
    [(8, 4), pytest.param(128, MAX_TOP_LOGPROB_ENTRIES // (128 * 128), marks=pytest.mark.slow)],
)
def test_a_top_logprobs_result_is_built_without_the_gate(pair, monkeypatch, width, new):
    """k the vocabulary (slow: the worst accepted request, k x beams x tokens at the bound): its
    result's top-logprob lists are built by the worker without the engine's gate, so a call
    that takes the gate (here from another thread, during the build) does not wait for it; the
    result equals a hand-driven engine's, whose results are built in place."""
    _, model = pair
    vocab = model.config.vocab_size
    assert vocab == 128
    sp = SamplingParams(max_new_tokens=new, n=width, ignore_eos=True)
    worst = GenerateRequest(PROMPT, sp, return_logprob=True, top_logprobs_num=vocab)
    cfg = EngineConfig(max_new_tokens=new, max_beam_width=width)
    eng = Engine(model, cfg)
    builds, build = [], Sequence.to_result

    def spy(seq, *args, **kwargs):
        caller = threading.Thread(target=eng.num_in_flight)  # takes the gate
        caller.start()
        caller.join(10.0)
        t0 = time.perf_counter()
        out = build(seq, *args, **kwargs)
        builds.append((caller.is_alive(), time.perf_counter() - t0))
        return out

    monkeypatch.setattr(Sequence, "to_result", spy)
    eng.start()
    try:
        got = eng.generate(worst, timeout=120)
    finally:
        eng.stop()
    monkeypatch.undo()
    assert [alive for alive, _ in builds] == [False]  # the caller got the gate mid-build
    print(f"result of {vocab * width * new} top logprobs built in {builds[0][1]:.3f} s")
    want = run_requests(Engine(model, cfg), [worst])[0]
    assert len(got.beams) == width
    for beam, ref in zip(got.beams, want.beams, strict=True):
        assert beam.output_ids == ref.output_ids
        assert beam.output_top_logprobs == ref.output_top_logprobs


def test_only_the_rows_that_ask_compute_top_logprobs(pair, monkeypatch):
    """A step computes the top-k of the rows of the requests that ask only (a behaviour one and
    an original_logprob one), each row once, beside a wide request that does not ask."""
    _, model = pair
    writes: dict[int, tuple[RowTops, list]] = {}
    put = RowTops.put_top

    def spy(self, rows, values, ids):
        writes.setdefault(id(self), (self, []))[1].extend(np.asarray(rows).tolist())
        put(self, rows, values, ids)

    monkeypatch.setattr(RowTops, "put_top", spy)
    vocab = model.config.vocab_size
    orig = dataclasses.replace(ask(3, 4, PROMPT[:14]), return_original_logprob=True)
    reqs = [ask(8, 0, PROMPT[:12]), ask(2, vocab), orig]
    results = run_requests(Engine(model, EngineConfig()), reqs)
    assert len(writes) >= NEW  # one table a step
    for tops, rows in writes.values():
        asking = np.flatnonzero(tops.at >= 0).tolist()
        assert sorted(rows) == asking  # each asking row once, no other row
        assert len(asking) == tops.top[0].shape[0] < len(tops.at)  # the wide one computes none
    assert results[0].beams[0].output_top_logprobs is None
    assert all(len(row) == vocab for b in results[1].beams for row in b.output_top_logprobs)
    assert all(len(row) == 4 for b in results[2].beams for row in b.output_top_logprobs)
