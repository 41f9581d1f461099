"""StagedRuns: the server's multi-stage requests by request id, for the routes that name one
after it was sent (docs/http-api.md "Multi-stage requests").

/submit and /submit_many queue them: each queued batch runs in a thread of its own through
engine/stages.py (as /generate's do in its handler's thread), and its replies are kept until
/result fetches them (/poll peeks), at most `max_finished` unfetched and `max_bytes` of their
JSON (the oldest go first, never the newest; a later fetch is a 404 saying so). /generate's
are known here while they run. Either kind is stopped by /abort_request or /cancel naming its
rid (engine/stages.Control.abort: its stage requests end "abort", no later stage runs) and by
/abort_request abort_all; the beam groups it reads are named so the route clears them. At most
`max_running` queued requests run at once (429 past it). `result` waits (the route runs it in
a worker thread); every other method is brief and may run on the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from grctl.engine.stages import Control, StagedRequest
from grctl.errors import DuplicateRequestId, GenerateTimeout, NotFound, Overloaded
from grctl.protocol.generate import GenerateResponse

EVICTED_IDS = 1024  # how many dropped ids a 404 still explains


@dataclass(eq=False)
class Run:
    request_id: str
    control: Control
    group_ids: tuple[str, ...]
    kept: bool  # queued by /submit: its reply waits for /result
    done: threading.Event = field(default_factory=threading.Event)
    reply: GenerateResponse | None = None
    error: BaseException | None = None
    nbytes: int = 0  # its reply's JSON


class StagedRuns:
    def __init__(self, max_running: int, max_finished: int, max_bytes: int | None = None):
        self.max_running, self.max_finished, self.max_bytes = max_running, max_finished, max_bytes
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, Run] = OrderedDict()  # queued ones, by id
        # /generate's while they run: several under one id only when each reads the same beam
        # group (verl-GR names every call of a group by the group's id)
        self._tracked: dict[str, list[Run]] = {}
        self._evicted: OrderedDict[str, None] = OrderedDict()
        # a beam group being computed -> the control and request id computing it
        self._computing: dict[str, tuple[Control, str]] = {}

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._runs or request_id in self._tracked

    def refuse_taken(self, request_ids: list[str | None]) -> None:
        """A one-stage request may not take a multi-stage request's id."""
        with self._lock:
            taken = next((r for r in request_ids if r in self._runs or r in self._tracked), None)
        if taken is not None:
            raise DuplicateRequestId(f"request id {taken!r} is already in use")

    def _is_taken(self, req: StagedRequest, kept: bool, is_known) -> bool:
        rid = req.request_id
        if rid in self._runs or is_known(rid):
            return True
        others = self._tracked.get(rid, [])
        # another call of the same beam group may share the id; anything else may not
        return bool(others) and (kept or not req.group_ids or others[0].group_ids != req.group_ids)

    def _add(self, reqs: list[StagedRequest], control: Control, kept: bool, is_known) -> list[Run]:
        ids = [r.request_id for r in reqs]
        if len(set(ids)) != len(ids):
            raise DuplicateRequestId("the batch repeats a request id; nothing was queued")
        with self._lock:
            taken = next((r.request_id for r in reqs if self._is_taken(r, kept, is_known)), None)
            if taken is not None:
                raise DuplicateRequestId(f"request id {taken!r} is already in use")
            if kept:
                running = sum(1 for r in self._runs.values() if r.kept and not r.done.is_set())
                if running + len(reqs) > self.max_running:
                    raise Overloaded(
                        f"{running} queued multi-stage requests are running (at most "
                        f"{self.max_running}, --max-waiting-requests)",
                        hint="retry later",
                    )
            runs = [Run(r.request_id, control, r.group_ids, kept) for r in reqs]
            for run in runs:
                if kept:
                    self._runs[run.request_id] = run
                else:
                    self._tracked.setdefault(run.request_id, []).append(run)
                self._evicted.pop(run.request_id, None)
            return runs

    @contextmanager
    def tracked(self, reqs: list[StagedRequest], control: Control, is_known) -> Iterator[None]:
        """/generate's requests, known by id while they run (`is_known`: the engine's ids)."""
        runs = self._add(reqs, control, False, is_known)
        try:
            yield
        finally:
            with self._lock:
                for run in runs:
                    others = self._tracked.get(run.request_id, [])
                    if run in others:
                        others.remove(run)
                    if not others:
                        self._tracked.pop(run.request_id, None)

    def start(
        self,
        reqs: list[StagedRequest],
        compute: Callable[[Control], list[GenerateResponse]],
        is_known,
    ) -> list[str]:
        """Queue a checked batch: compute(control) runs it in a thread of its own; each reply
        (or the error that ended the batch) is kept under its request's id."""
        control = Control()
        runs = self._add(reqs, control, True, is_known)

        def work() -> None:
            try:
                replies = compute(control)
                for run, reply in zip(runs, replies, strict=True):
                    run.reply, run.nbytes = reply, len(msgspec.json.encode(reply))
            except BaseException as exc:  # every request of the batch answers it
                for run in runs:
                    run.error = exc
            finally:
                for run in runs:
                    run.done.set()
                self._evict()

        threading.Thread(target=work, name="grctl-staged", daemon=True).start()
        return [r.request_id for r in reqs]

    def _evict(self) -> None:
        with self._lock:
            done = [r for r in self._runs.values() if r.kept and r.done.is_set()]
            total = sum(r.nbytes for r in done)
            # the oldest first, never the newest
            for run in done[:-1]:
                over_bytes = self.max_bytes is not None and total > self.max_bytes
                if len(done) <= self.max_finished and not over_bytes:
                    break
                del self._runs[run.request_id]
                self._evicted[run.request_id] = None
                done = done[1:]
                total -= run.nbytes
            while len(self._evicted) > EVICTED_IDS:
                self._evicted.popitem(last=False)

    def get(self, request_id: str) -> Run | None:
        """A queued request's run; None when it is not one of them."""
        with self._lock:
            run = self._runs.get(request_id)
            if run is None and request_id in self._evicted:
                raise NotFound(
                    f"the result of {request_id!r} was dropped unfetched: the finished "
                    f"multi-stage requests kept were over --max-finished-results "
                    f"({self.max_finished}) or --max-finished-result-bytes ({self.max_bytes})",
                    hint="fetch results sooner, or raise those bounds",
                )
            return run if run is not None and run.kept else None

    def poll(self, run: Run) -> GenerateResponse | None:
        if not run.done.is_set():
            return None
        if run.error is not None:
            self._pop(run)
            raise run.error
        return run.reply

    def result(self, run: Run, timeout: float | None) -> GenerateResponse:
        if not run.done.wait(timeout):
            raise GenerateTimeout(f"request {run.request_id!r} did not finish in {timeout}s")
        self._pop(run)
        if run.error is not None:
            raise run.error
        assert run.reply is not None
        return run.reply

    def _pop(self, run: Run) -> None:
        with self._lock:
            if self._runs.get(run.request_id) is run:
                del self._runs[run.request_id]

    @contextmanager
    def computing(self, group_id: str, control: Control, request_id: str) -> Iterator[None]:
        """A beam group being computed by `request_id`'s run: an abort of any call reading the
        group stops it."""
        with self._lock:
            self._computing[group_id] = (control, request_id)
        try:
            yield
        finally:
            with self._lock:
                if self._computing.get(group_id) == (control, request_id):
                    del self._computing[group_id]

    def abort(self, engine: Any, request_id: str) -> tuple[str, ...] | None:
        """Abort a running request (its stages end "abort"), and the computation of any beam
        group it reads; the group ids it reads (to clear), or None when no such request runs."""
        with self._lock:
            runs = [*self._tracked.get(request_id, ())]
            kept = self._runs.get(request_id)
            if kept is not None and not kept.done.is_set():
                runs.append(kept)
            if not runs:
                return None
            groups = tuple(dict.fromkeys(g for run in runs for g in run.group_ids))
            owners = [self._computing[g] for g in groups if g in self._computing]
        for run in runs:
            run.control.abort(engine, request_id)
        for control, owner in owners:
            control.abort(engine, owner)
        return groups

    def abort_all(self, engine: Any) -> int:
        """Abort every running request; how many ids that was."""
        with self._lock:
            runs = [r for r in self._runs.values() if not r.done.is_set()]
            runs += [r for rs in self._tracked.values() for r in rs]
        for run in runs:
            run.control.abort(engine, run.request_id)
        return len({r.request_id for r in runs})
