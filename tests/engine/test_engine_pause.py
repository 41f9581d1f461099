"""Pause modes with requests in flight: abort, retract, in_place; and flush_cache around them.

Stepped by hand (no worker) so the pause lands at a known point: after one step, two requests
are running (holding KV, one output token decoded past the prefill) and one is waiting.
"""

from __future__ import annotations

import time

import pytest

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import NotReady, Paused, PauseTimeout
from tests.support.reference import hf_and_ours

PROMPTS = [tuple(range(5, 25)), tuple(range(40, 47)), tuple(range(60, 91))]


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(seed=11)[1]


def requests() -> list[GenerateRequest]:
    return [
        GenerateRequest(p, SamplingParams(max_new_tokens=6, n=n))
        for p, n in zip(PROMPTS, (1, 4, 3), strict=True)
    ]


def make(model) -> Engine:
    return Engine(model, EngineConfig(max_running_requests=2, enable_prefill_cache=True))


def run_all(eng: Engine) -> None:
    while eng.run_step():
        pass


@pytest.fixture(scope="module")
def reference(model):
    eng = make(model)
    ids = [eng.submit(r) for r in requests()]
    run_all(eng)
    return [eng.result(i) for i in ids]


def in_flight(eng: Engine) -> list[str]:
    ids = [eng.submit(r) for r in requests()]
    eng.run_step()
    sched = eng.status()["scheduler"]
    assert sched["running"] == 2 and sched["waiting"] == 1
    return ids


def same_outputs(results, reference) -> bool:
    return all(
        [b.output_ids for b in r.beams] == [b.output_ids for b in ref.beams]
        for r, ref in zip(results, reference, strict=True)
    )


def test_abort_ends_everything_in_flight(model):
    eng = make(model)
    ids = in_flight(eng)
    assert eng.pause("abort") == 3
    results = [eng.result(i) for i in ids]
    assert all(r.finish_reason == "abort" for r in results)
    assert [len(r.output_ids) for r in results] == [2, 2, 0]  # prefill token + one decode
    assert eng.num_in_flight() == 0 and "paused" in eng.ready_reasons()
    with pytest.raises(Paused):
        eng.submit(requests()[0])
    assert eng.flush_cache() == (True, 2)
    eng.resume()
    eng.submit(requests()[0])


def test_retract_keeps_tokens_and_a_write_recomputes_their_kv(model, reference):
    """Retracted requests keep their tokens; a write while they wait drops their KV, and they
    are recomputed (prompt, then each beam's tokens) and decode on: written with the same
    weights, every beam ends as if never paused."""
    eng = make(model)
    ids = in_flight(eng)
    assert eng.flush_cache() == (False, 0)  # running requests hold KV
    assert eng.pause("retract") == 0
    sched = eng.status()["scheduler"]
    assert sched["running"] == 0 and sched["waiting"] == 3 and sched["pause_mode"] == "retract"
    assert sched["retracted_holding_kv"] == 2
    assert eng.flush_cache(timeout=0) == (True, 2)  # retracted requests do not block it
    assert not eng.run_step()
    with eng.exclusive() as aborted:  # a write while they wait: their KV is of old weights
        assert aborted == 0
        eng.weights_written("v2", mix=None)
    assert eng.status()["scheduler"]["retracted_holding_kv"] == 0
    eng.resume()
    run_all(eng)
    results = [eng.result(i) for i in ids]
    assert same_outputs(results, reference)
    assert all(r.finish_reason == "length" for r in results)
    assert [r.token_versions for r in results] == [["default"] * 2 + ["v2"] * 4] * 2 + [["v2"] * 6]
    assert [(r.num_retractions, r.kv_recomputed_at) for r in results] == [(1, [2])] * 2 + [(0, [])]
    # the two prompts twice, their one kept token per beam, the third prompt once
    recomputed = 1 * 1 + 1 * 4
    assert (
        eng.status()["scheduler"]["prefill_tokens"]
        == 2 * sum(map(len, PROMPTS[:2])) + len(PROMPTS[2]) + recomputed
    )


def test_in_place_freezes_and_resumes_where_they_were(model, reference):
    eng = make(model)
    ids = in_flight(eng)
    before = eng.status()["scheduler"]
    assert eng.pause("in_place") == 0
    assert not eng.run_step() and eng.flush_cache(timeout=0.05) == (False, 0)
    assert eng.status()["scheduler"]["steps"] == before["steps"]
    eng.resume()
    run_all(eng)
    results = [eng.result(i) for i in ids]
    assert same_outputs(results, reference)
    # not restarted: each prompt was prefilled exactly once
    assert eng.status()["scheduler"]["prefill_tokens"] == sum(map(len, PROMPTS))
    assert eng.flush_cache() == (True, 3)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_with_the_worker_running(model, reference, mode):
    """Wherever the pause lands, frozen or retracted requests end as if never paused."""
    eng = make(model)
    eng.start()
    ids = [eng.submit(r) for r in requests()]
    assert eng.pause(mode) == 0
    steps = eng.status()["scheduler"]["steps"]
    time.sleep(0.05)
    assert eng.status()["scheduler"]["steps"] == steps  # nothing computes while paused
    eng.resume()
    results = [eng.result(i, timeout=30) for i in ids]
    eng.stop()
    assert same_outputs(results, reference)


def test_pause_abort_with_the_worker_running(model):
    eng = make(model)
    eng.start()
    ids = [eng.submit(r) for r in requests()]
    aborted = eng.pause("abort")
    results = [eng.result(i, timeout=30) for i in ids]
    eng.stop()
    assert aborted == sum(r.finish_reason == "abort" for r in results)
    assert eng.num_in_flight() == 0


def test_pause_gives_up_when_the_step_does_not_end(model):
    """A step that never ends (a hung kernel) must not hang /pause_generation: after
    pause_timeout_s it is a retryable 503 pause_timeout, and no new step starts meanwhile."""
    eng = Engine(model, EngineConfig(pause_timeout_s=0.3))
    eng.submit(requests()[0])
    with eng.gate:
        eng.gate.is_computing = True  # the worker is inside a step that does not come back
    t0 = time.monotonic()
    with pytest.raises(PauseTimeout, match="did not end within 0.3 s") as err:
        eng.pause("abort")
    assert time.monotonic() - t0 < 5
    assert (err.value.status, err.value.code, err.value.retryable) == (503, "pause_timeout", True)
    assert eng.gate.is_paused and eng.num_in_flight() == 1  # paused, nothing aborted yet
    with eng.gate:
        eng.gate.is_computing = False  # the step ends after all: a second pause goes through
    assert eng.pause("abort") == 1


def test_a_dead_worker_refuses_requests(model):
    """A worker thread that died takes no more requests: 503 not_ready, never a request that
    waits for a worker that is gone."""
    eng = Engine(model, EngineConfig())

    def die() -> bool:
        raise SystemExit  # what no `except Exception` in the worker catches

    eng.worker.run_step = die
    eng.start()
    eng.submit(requests()[0])  # wakes the worker, which dies on it
    eng.worker._thread.join(5)
    assert not eng.gate.worker_alive
    with pytest.raises(NotReady, match="worker") as err:
        eng.submit(requests()[1])
    assert (err.value.status, err.value.code, err.value.retryable) == (503, "not_ready", True)
