"""One request's failure in a step ends that request only: the step's other requests run on
and finish as they would have without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from tests.support.engines import run_requests
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


# ---- failures after the model: the batched selection, the stop strings, a seeded re-run ----


def innocents() -> list[GenerateRequest]:
    """Greedy, deterministic beams, a seeded sample, seeded stochastic beams (a re-run must
    draw the same noise); the width-1 ones watch a stop string that never appears."""
    kinds = [
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop=("never",)),
        SamplingParams(max_new_tokens=NEW, n=3, ignore_eos=True),
        SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=7, ignore_eos=True, stop=("z",)),
        SamplingParams(max_new_tokens=NEW, n=3, temperature=0.8, seed=11, ignore_eos=True),
    ]
    return [
        GenerateRequest(tuple(range(3 + i, 12 + 2 * i)), sp, return_logprob=True, detokenize=spell)
        for i, sp in enumerate(kinds)
    ]


def spell(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def culprit(stage: str) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop=("x",))
    if stage != "stop_string":  # it asks for top logprobs: the fault fires on its gathers
        return GenerateRequest(
            (40, 41, 42), sp, return_logprob=True, top_logprobs_num=5, detokenize=spell
        )

    def broken(ids: list[int]) -> str:  # the tokenizer cannot spell its second token
        if len(ids) > 1:
            raise ValueError("cannot detokenize this request's tokens")
        return spell(ids)

    return GenerateRequest((40, 41, 42), sp, detokenize=broken)


def fail_selection_on_top_logprobs(monkeypatch, started: bool) -> None:
    """beam_select.step fails, after drawing every request's noise, whenever a request asking
    for top logprobs is in a first-token selection (started=False) or a decode one (True), as
    its [requests, width, k] gathers running out of memory would."""
    from grctl.engine.search import beam_select

    real = beam_select.step

    def faulty(logits, blocks):
        if any(b.beams.top_logprobs and b.beams.is_started == started for b in blocks):
            for b in blocks:
                if b.beams.generator is not None:
                    torch.rand(64, generator=b.beams.generator)
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(logits, blocks)

    monkeypatch.setattr(beam_select, "step", faulty)


def assert_same(got, want) -> None:
    """The same beams' tokens exactly; scores and logprobs to fp32 rounding (batches differ)."""
    for g, w in zip(got, want, strict=True):
        assert [b.output_ids for b in g.beams] == [b.output_ids for b in w.beams]
        for gb, wb in zip(g.beams, w.beams, strict=True):
            assert gb.sequence_score == pytest.approx(wb.sequence_score, abs=1e-4)
            assert gb.output_token_logprobs == pytest.approx(wb.output_token_logprobs, abs=1e-4)


@pytest.mark.parametrize("stage", ["first_token", "decode_selection", "stop_string"])
def test_a_failure_after_the_model_ends_only_its_request(model, monkeypatch, stage):
    want = run_requests(Engine(model, EngineConfig()), innocents())
    if stage != "stop_string":
        fail_selection_on_top_logprobs(monkeypatch, started=stage == "decode_selection")
    eng = Engine(model, EngineConfig())
    reqs = innocents()
    got = run_requests(eng, [*reqs[:2], culprit(stage), *reqs[2:]])
    assert got.pop(2).finish_reason == "abort"
    assert_same(got, want)
    assert all(r.finish_reason == "length" for r in got)
    status = eng.status()
    assert status["requests"]["aborted"] == 1 and status["engine"]["errors"] >= 1


REAL_OOM = """
import resource
import torch
torch.set_num_threads(1)
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

model = hf_and_ours(seed=5)[1]
def innocents():
    kinds = [(1, 0.0), (3, 0.0), (1, 1.0)]
    return [
        GenerateRequest(
            tuple(range(3 + i, 12 + i)),
            SamplingParams(max_new_tokens=4, n=n, temperature=t, seed=7, ignore_eos=True),
        )
        for i, (n, t) in enumerate(kinds)
    ]
want = run_requests(Engine(model, EngineConfig(max_new_tokens=512)), innocents())
eng = Engine(model, EngineConfig(max_new_tokens=512))
# 128 beams of 400 tokens: a 39 MB beam KV, allocated after the wave's first-token selection
culprit = GenerateRequest((40, 41, 42), SamplingParams(max_new_tokens=400, n=128, ignore_eos=True))
reqs = innocents()
rids = [eng.submit(r) for r in [reqs[0], culprit, *reqs[1:]]]
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + 8 * 2**20, resource.RLIM_INFINITY))
while eng.run_step():
    pass
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
got = [eng.result(r) for r in rids]
assert got[1].finish_reason == "abort", got[1].finish_reason
assert "can't allocate memory" in eng.status()["engine"]["last_error"]
rest = [got[0], *got[2:]]
beams = lambda results: [[b.output_ids for b in r.beams] for r in results]  # noqa: E731
assert beams(rest) == beams(want)
assert [r.finish_reason for r in rest] == ["length"] * 3
print("ok")
"""


@pytest.mark.slow  # a child process building two engines: about 15 s on a loaded machine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_a_real_allocation_failure_ends_only_its_request():
    """Under RLIMIT_AS (in a child process of its own), one request's beam KV cannot be
    allocated after its wave's first tokens: it alone ends, the others give what they give
    without it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", REAL_OOM], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
