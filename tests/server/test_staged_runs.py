"""StagedRuns (grctl/server/staged_runs.py), the store of queued multi-stage requests, on its
own: kept until fetched within its count and byte bounds (the oldest dropped first, never the
newest, and a fetch of a dropped one a 404 naming both bounds), at most max_running running, ids
unique against the engine's, an error answered by every request of its batch, an abort reaching
a run's Control. The routes over it run against a real server in tests/server/test_stages.py
and tests/e2e/test_stage_abort.py."""

from __future__ import annotations

import threading

import msgspec
import pytest

from grctl.engine.search.params import SamplingParams
from grctl.engine.stages import Control, StagedRequest
from grctl.errors import DuplicateRequestId, NotFound, Overloaded
from grctl.protocol.generate import GenerateResponse
from grctl.server.staged_runs import StagedRuns


def staged(rid: str, group: str | None = None) -> StagedRequest:
    return StagedRequest(
        request_id=rid,
        input_ids=(1, 2),
        reasoning=SamplingParams(),
        num_samples=1,
        prefix_ids=(),
        items=SamplingParams(),
        group_ids=(group,) if group else (),
    )


def unknown(_rid: str) -> bool:
    return False


def run_one(runs: StagedRuns, rid: str, text: str = "x") -> GenerateResponse:
    runs.start([staged(rid)], lambda _c: [GenerateResponse(text=text)], unknown)
    run = runs.get(rid)
    assert run is not None
    assert run.done.wait(10)
    return run.reply


class Engine:
    def __init__(self):
        self.cancelled: list[str] = []

    def cancel(self, rid: str) -> bool:
        self.cancelled.append(rid)
        return True


def test_kept_until_fetched_then_gone():
    runs = StagedRuns(max_running=4, max_finished=8)
    reply = run_one(runs, "a", "hello")
    run = runs.get("a")
    assert runs.poll(run) == reply and runs.poll(run) == reply  # poll peeks
    assert runs.result(run, 1.0).text == "hello"  # result takes
    assert runs.get("a") is None and "a" not in runs


def test_the_oldest_unfetched_go_past_the_count_bound():
    runs = StagedRuns(max_running=4, max_finished=2)
    for rid in ("a", "b", "c"):
        run_one(runs, rid)
    with pytest.raises(NotFound, match="--max-finished-results"):
        runs.get("a")
    assert runs.get("b") is not None and runs.get("c") is not None


def test_the_oldest_unfetched_go_past_the_byte_bound_never_the_newest():
    one = len(msgspec.json.encode(GenerateResponse(text="y" * 1000)))
    runs = StagedRuns(max_running=4, max_finished=100, max_bytes=one + one // 2)
    run_one(runs, "a", "y" * 1000)
    run_one(runs, "b", "y" * 1000)
    with pytest.raises(NotFound, match="--max-finished-result-bytes"):
        runs.get("a")
    run_one(runs, "huge", "y" * 10_000)  # over the bound alone: kept, the others go
    assert runs.get("huge") is not None
    with pytest.raises(NotFound):
        runs.get("b")


def test_at_most_max_running_run_and_ids_are_unique():
    runs = StagedRuns(max_running=1, max_finished=8)
    go = threading.Event()

    def blocked(_control):
        go.wait(10)
        return [GenerateResponse()]

    runs.start([staged("a")], blocked, unknown)
    with pytest.raises(Overloaded):
        runs.start([staged("b")], blocked, unknown)
    with pytest.raises(DuplicateRequestId):
        runs.start([staged("a")], blocked, unknown)
    with pytest.raises(DuplicateRequestId):  # the engine holds it
        StagedRuns(4, 8).start([staged("e")], blocked, lambda rid: rid == "e")
    with pytest.raises(DuplicateRequestId):
        runs.refuse_taken(["a"])
    go.set()
    assert runs.result(runs.get("a"), 10.0) is not None
    runs.refuse_taken(["a"])  # fetched: free again


def test_an_error_is_every_request_of_its_batch_answer():
    runs = StagedRuns(max_running=4, max_finished=8)

    def fails(_control):
        raise ValueError("stage failed")

    runs.start([staged("a"), staged("b")], fails, unknown)
    for rid in ("a", "b"):
        run = runs.get(rid)
        assert run.done.wait(10)
        with pytest.raises(ValueError, match="stage failed"):
            runs.result(run, 1.0)


def test_an_abort_reaches_the_run_and_the_group_it_waits_for():
    runs = StagedRuns(max_running=4, max_finished=8)
    engine, go = Engine(), threading.Event()

    def blocked(_control):
        go.wait(10)
        return [GenerateResponse()]

    runs.start([staged("a", group="g")], blocked, unknown)
    computing = threading.Event()
    # another request computes the group "a" reads: an abort of "a" stops it too
    other, release = [], threading.Event()

    def compute_group():
        control = Control()
        other.append(control)
        with runs.computing("g", control, "owner"):
            computing.set()
            release.wait(10)

    t = threading.Thread(target=compute_group)
    t.start()
    assert computing.wait(10)
    assert runs.abort(engine, "a") == ("g",)
    assert runs.get("a").control.is_aborted("a") and other[0].is_aborted("owner")
    release.set()
    t.join(10)
    go.set()
    assert runs.result(runs.get("a"), 10.0) is not None
    assert runs.abort(engine, "a") is None  # finished: nothing to abort
    assert runs.abort(engine, "nobody") is None


def test_calls_of_one_beam_group_may_share_an_id():
    """verl-GR names each call of a group by the group's id: /generate's calls of one group
    share it, and an abort of it reaches each; another group, or a queued request, may not."""
    runs, engine = StagedRuns(max_running=4, max_finished=8), Engine()
    one, two = Control(), Control()
    with runs.tracked([staged("g", group="g")], one, unknown):
        with runs.tracked([staged("g", group="g")], two, unknown):
            with pytest.raises(DuplicateRequestId):
                with runs.tracked([staged("g", group="other")], Control(), unknown):
                    pass
            with pytest.raises(DuplicateRequestId):
                runs.start([staged("g", group="g")], lambda _c: [GenerateResponse()], unknown)
            with pytest.raises(DuplicateRequestId):
                runs.refuse_taken(["g"])
            assert runs.abort(engine, "g") == ("g",)
            assert one.is_aborted("g") and two.is_aborted("g")
        assert "g" in runs
    assert "g" not in runs and runs.abort(engine, "g") is None
    with pytest.raises(DuplicateRequestId):  # without a group an id is one request's
        with runs.tracked([staged("x")], Control(), unknown):
            with runs.tracked([staged("x")], Control(), unknown):
                pass
