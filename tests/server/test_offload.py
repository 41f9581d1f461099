"""offload() (grctl/server/offload.py) and Engine.generate_many: cancelling leaves nothing behind.

A handler cancelled while its call runs stops the call (on_cancel) and returns only once the
thread has ended; a call still waiting for a thread never runs. A batch that times out, or whose
waiter is cancelled, leaves no request queued and no result stored.
"""

from __future__ import annotations

import threading

import anyio
import pytest
from litestar.datastructures import State

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import DuplicateRequestId, GenerateTimeout
from grctl.server.offload import offload
from tests.support.reference import hf_and_ours


def test_a_cancelled_call_is_stopped_and_awaited():
    state = State({"waiters": anyio.CapacityLimiter(4)})
    stop, ended = threading.Event(), []

    def work() -> None:
        assert stop.wait(10), "on_cancel never stopped the work"
        ended.append(True)

    async def main() -> None:
        with anyio.move_on_after(0.2) as scope:
            await offload(state, work, on_cancel=stop.set)
        assert scope.cancelled_caught
        assert ended == [True]  # the thread had ended before offload gave up

    anyio.run(main)


def test_a_call_that_never_got_a_thread_never_runs():
    state = State({"waiters": anyio.CapacityLimiter(1)})
    hold, ran = threading.Event(), []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(offload, state, hold.wait)  # takes the only waiter thread
            await anyio.sleep(0.05)
            with anyio.move_on_after(0.1):
                await offload(state, ran.append, 1)
            hold.set()
        assert ran == []

    anyio.run(main)


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(seed=5)[1]


def reqs(*rids: str) -> list[GenerateRequest]:
    return [
        GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=2), request_id=r) for r in rids
    ]


def test_generate_many_answers_in_order(model):
    eng = Engine(model, EngineConfig())
    eng.start()
    try:
        batch = eng.generate_many(reqs("a", "b", "c"), timeout=30)
        assert [r.request_id for r in batch] == ["a", "b", "c"]
        single = eng.generate(reqs("d")[0], timeout=30)
        assert all(r.output_ids == single.output_ids for r in batch)
    finally:
        eng.stop()


def test_a_batch_that_times_out_leaves_nothing(model):
    eng = Engine(model, EngineConfig())  # no worker: nothing finishes
    with pytest.raises(GenerateTimeout):
        eng.generate_many(reqs("a", "b"), timeout=0.05)
    assert eng.num_in_flight() == 0 and len(eng.results) == 0


def test_a_batch_is_queued_whole_or_not_at_all(model):
    eng = Engine(model, EngineConfig())
    eng.submit(reqs("taken")[0])
    with pytest.raises(DuplicateRequestId):
        eng.generate_many(reqs("x", "taken"), timeout=1)
    assert eng.num_in_flight() == 1 and len(eng.results) == 0  # only the earlier request
