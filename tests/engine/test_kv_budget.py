"""Admission by KV bytes: running requests never hold more than --max-kv-bytes, a request that
could never fit is refused at submit, and the rest wait their turn."""

from __future__ import annotations

import pytest

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.kv_cache import request_kv_bytes
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import ValidationError
from tests.support.reference import hf_and_ours

PROMPT, BEAMS, NEW = 40, 4, 3


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(seed=11)[1]


def request(i: int, prompt_len: int = PROMPT) -> GenerateRequest:
    ids = tuple((7 * i + j) % 100 for j in range(prompt_len))
    return GenerateRequest(ids, SamplingParams(max_new_tokens=NEW, n=BEAMS))


def test_running_requests_stay_within_the_kv_budget(model):
    one = request_kv_bytes(model.config, 4, PROMPT, BEAMS, NEW)
    eng = Engine(model, EngineConfig(max_kv_bytes=2 * one + one // 2))
    ids = [eng.submit(request(i)) for i in range(5)]
    admitted = []
    while eng.run_step():
        status = eng.status()["scheduler"]
        assert status["kv_bytes_admitted"] <= status["kv_bytes_budget"]
        # the held KV (context once per request, tails per beam) is within the estimate
        assert status["context_kv_bytes"] + status["beam_kv_bytes"] <= status["kv_bytes_admitted"]
        admitted.append(status["running"])
    assert max(admitted) == 2 and admitted[0] == 2  # two fit, the third waits
    results = [eng.result(i) for i in ids]
    assert all(len(r.beams) == BEAMS and r.finish_reason == "length" for r in results)
    unbounded = Engine(model, EngineConfig())
    assert unbounded.status()["scheduler"]["kv_bytes_budget"] is None  # CPU default: no limit
    ref_ids = [unbounded.submit(request(i)) for i in range(5)]
    while unbounded.run_step():
        pass
    assert [r.output_ids for r in results] == [unbounded.result(i).output_ids for i in ref_ids]


def test_a_request_larger_than_the_budget_is_refused_at_submit(model):
    eng = Engine(
        model, EngineConfig(max_kv_bytes=request_kv_bytes(model.config, 4, 30, BEAMS, NEW))
    )
    with pytest.raises(ValidationError, match="--max-kv-bytes"):
        eng.submit(request(0, prompt_len=31))
    assert eng.num_in_flight() == 0
    eng.submit(request(0, prompt_len=30))  # exactly the budget: runs
    while eng.run_step():
        pass


def test_the_logits_rows_of_a_step_count_beside_the_kv(model):
    """A step holds [beams, vocab] fp32 scores per request whatever its context: a request whose
    KV alone fits the budget but whose scores do not is refused, not admitted to fail later."""
    cfg = model.config
    kv_only = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * (30 + BEAMS * (NEW - 1))
    with pytest.raises(ValidationError, match="--max-kv-bytes"):
        Engine(model, EngineConfig(max_kv_bytes=kv_only)).submit(request(0, prompt_len=30))
    roomy = kv_only + BEAMS * cfg.vocab_size * 4 * 8
    Engine(model, EngineConfig(max_kv_bytes=roomy)).submit(request(0, prompt_len=30))
