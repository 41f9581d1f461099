"""Top log-probabilities within the memory budget: only the requests that ask keep them (a
request that does not ask, beside one that does, keeps no [rows, k] rows), what they keep counts
in --max-kv-bytes and is bounded per request, and each is transformers' own top-k of the beam's
prefix."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.kv_cache import top_logprobs_bytes
from grctl.engine.request import GenerateRequest, SamplingParams
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
