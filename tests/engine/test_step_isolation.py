"""One request's failure in a step ends that request only: the step's other requests run on
and finish as they would have without it."""

from __future__ import annotations

import pytest

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from tests.support.reference import hf_and_ours

NEW = 4
CULPRIT_LEN = 13  # the prompt length that makes the model fail


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(seed=5)[1]


def requests() -> list[GenerateRequest]:
    lengths = (9, CULPRIT_LEN, 17, 21)
    return [
        GenerateRequest(
            tuple((5 * i + j) % 90 + 3 for j in range(n)),
            SamplingParams(max_new_tokens=NEW, n=3, ignore_eos=True),
        )
        for i, n in enumerate(lengths)
    ]


def run(eng: Engine) -> list:
    ids = [eng.submit(r) for r in requests()]
    while eng.run_step():
        pass
    return [eng.result(i) for i in ids]


def fail_on_culprit(runner, stage: str) -> None:
    """The runner's `stage` raises whenever the culprit's prompt is among its inputs."""
    real = getattr(runner, stage)

    def faulty(batch, *rest):  # prefill's rest: the prompts' cached prefixes
        lengths = [len(p) for p in batch] if stage == "prefill" else [i.ctx.length for i in batch]
        if CULPRIT_LEN in lengths:
            raise RuntimeError("out of memory for this request")
        return real(batch, *rest)

    setattr(runner, stage, faulty)


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_only_the_failing_request_ends(model, stage):
    want = run(Engine(model, EngineConfig()))
    eng = Engine(model, EngineConfig())
    fail_on_culprit(eng.runner, stage)
    got = run(eng)
    culprit = [len(r.input_ids) for r in requests()].index(CULPRIT_LEN)
    assert got[culprit].finish_reason == "abort"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i == culprit:
            continue
        assert g.finish_reason == w.finish_reason == "length"
        assert [b.output_ids for b in g.beams] == [b.output_ids for b in w.beams]
    status = eng.status()
    assert status["requests"]["aborted"] == 1
    assert status["engine"]["errors"] == 1
    assert "out of memory for this request" in status["engine"]["last_error"]
