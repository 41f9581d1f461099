"""Multi-stage requests: reason, then recommend, under one weight version per sample.

A StagedRequest samples `num_samples` reasonings of its prompt (stage 1: one request of width 1
per sample, all in one engine batch), appends the forced prefix to each, and searches the item
beams of every sample from the prompt + reasoning + prefix (stage 2: one beam request per
sample, all in one batch; its context is prefilled once and read by all its beams, the prompt
part served from the prefix cache). A group is one sample and its beams.

One policy per sample: the weights' write generation is read before a group's stage 1 is
queued and after its stage 2 ends; a group whose generation moved, or whose tokens carry more
than one weight label (a retract or in_place pause with a write inside a stage, a relabel), is
run again from stage 1, up to MAX_RESTARTS times, then ends "abort" with no beams. A stage
ending "abort" (an abort pause, /abort_request) ends its group so. A stage that must be queued
while generation is paused waits for the resume. `hooks` are test-only (grctl/testing/faults.py
forces weight writes at the boundaries through them).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grctl.engine.request import GenerateRequest, GenerateResult
from grctl.engine.search.params import SamplingParams
from grctl.errors import GenerateTimeout, Paused

if TYPE_CHECKING:
    from grctl.engine.engine import Engine

MAX_RESTARTS = 3
# test-only: called with (boundary, request id) at "before_reasoning", "after_reasoning" and
# "after_items"; a hook may block (grctl/testing/faults.py)
hooks: list[Callable[[str, str], None]] = []


@dataclass(frozen=True)
class StagedRequest:
    request_id: str
    input_ids: tuple[int, ...]
    reasoning: SamplingParams  # n 1; sample i's seed is seed + i
    num_samples: int
    prefix_ids: tuple[int, ...]
    items: SamplingParams  # the item stage's; group i's seed is seed + i
    best_only: bool = False
    group_ids: tuple[str, ...] = ()  # one per sample; () names them <request id>:<i>
    group_index: int = 0  # with a beam_group_id: the beam_index to answer with
    detokenize: Callable[[list[int]], str] | None = None
    stage_template: GenerateRequest = GenerateRequest(input_ids=(0,))  # the text options etc.
    include_stop_str: bool = True  # text only: keep the reasoning's matched stop string


@dataclass
class Group:
    request: StagedRequest
    index: int
    reasoning: GenerateResult | None = None
    items: GenerateResult | None = None
    restarts: int = 0
    aborted: bool = False
    generation: int = -1  # the weights' write generation when its stage 1 was queued

    @property
    def group_id(self) -> str:
        ids = self.request.group_ids
        return ids[self.index] if ids else f"{self.request.request_id}:{self.index}"

    @property
    def is_done(self) -> bool:
        return self.aborted or self.items is not None

    @property
    def context(self) -> tuple[int, ...]:
        assert self.reasoning is not None
        req = self.request
        return (*req.input_ids, *self.reasoning.output_ids, *req.prefix_ids)

    def stage_request(self, stage: int, context: tuple[int, ...] | None = None) -> GenerateRequest:
        """Stage 1's request or stage 2's (over `context`: by default its own reasoning's)."""
        req = self.request
        sp = req.reasoning if stage == 1 else req.items
        if sp.seed is not None:
            sp = dataclasses.replace(sp, seed=sp.seed + self.index)
        return dataclasses.replace(
            req.stage_template,
            input_ids=req.input_ids if stage == 1 else context or self.context,
            sampling=sp,
            return_logprob=True,  # the behaviour logprobs of every token, always returned
            request_id=f"{req.request_id}:s{stage}:{self.index}:{self.restarts}",
            return_original_logprob=False,
            logprob_start_len=-1,
            detokenize=req.detokenize,
            keep_output_kv=stage == 1,  # its item stage continues this sample's own KV
        )


@dataclass
class Control:
    """What stops a run's stage requests: the handler being cancelled (its client went away:
    `cancel`, every request's stages discarded), or an abort of one request (`abort`,
    /abort_request by its rid: its stage requests in flight end "abort", no later stage of it
    runs, and its reply says so). `live` maps each stage request in the engine to its request."""

    live: dict[str, str] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cancel(self, engine: Engine) -> None:
        with self.lock:
            self.cancelled = True
            live = list(self.live)
        engine.discard(live)

    def abort(self, engine: Engine, request_id: str) -> None:
        with self.lock:
            self.aborted.add(request_id)
            for rid, owner in self.live.items():
                if owner == request_id:
                    engine.cancel(rid)

    def is_aborted(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self.aborted

    def queued(self, engine: Engine, owners: dict[str, str]) -> None:
        """The stage requests `owners` names are in the engine: an abort (or a cancel) that
        came while they were being queued reaches them now."""
        with self.lock:
            self.live.update(owners)
            for rid, owner in owners.items():
                if self.cancelled or owner in self.aborted:
                    engine.cancel(rid)

    def ended(self, rids: list[str]) -> None:
        with self.lock:
            for rid in rids:
                self.live.pop(rid, None)


@dataclass
class StagedResult:
    request: StagedRequest
    groups: list[Group]
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)


def _labels(result: GenerateResult) -> set[str]:
    return set(result.token_versions) or {result.weight_version}


def run(
    engine: Engine,
    reqs: list[StagedRequest],
    timeout: float | None = None,
    control: Control | None = None,
) -> list[StagedResult]:
    """Every request's groups to their end (see the module's docstring)."""
    control = control or Control()
    t0 = time.monotonic()
    deadline = None if timeout is None else t0 + timeout
    groups = {r.request_id: [Group(r, i) for i in range(r.num_samples)] for r in reqs}
    todo = [g for gs in groups.values() for g in gs]
    first = True
    while todo:
        for g in todo:
            _fire("before_reasoning", g)
        todo = _unless_aborted(todo, control)
        g_gen = _generation(engine)
        for g in todo:
            g.generation = g_gen
        results = _submit_wait(engine, todo, 1, deadline, first, control)
        first = False
        for g, r in zip(todo, results, strict=True):
            g.reasoning = r
        for g in todo:
            _fire("after_reasoning", g)
        live = []
        for g in _unless_aborted(todo, control):
            if g.reasoning.finish_reason == "abort":
                g.aborted = True
            elif len(_labels(g.reasoning)) > 1:
                _restart(g, control)
            else:
                live.append(g)
        results = _submit_wait(engine, live, 2, deadline, False, control)
        now = _generation(engine)
        for g, r in zip(live, results, strict=True):
            if r.finish_reason == "abort" and control.is_aborted(g.request.request_id):
                g.aborted = True  # its partial beams are returned, marked "abort"
                g.items = r if r.beams else None
            elif r.finish_reason == "abort" and not r.beams:
                g.aborted = True
            elif now != g.generation or len(_labels(g.reasoning) | _labels(r)) > 1:
                _restart(g, control)
            else:
                g.items = r
                _fire("after_items", g)
        todo = [g for gs in groups.values() for g in gs if not g.is_done]
    latency = time.monotonic() - t0
    return [StagedResult(r, groups[r.request_id], latency) for r in reqs]


def _restart(g: Group, control: Control) -> None:
    g.restarts += 1
    g.items = None
    if g.restarts > MAX_RESTARTS or control.is_aborted(g.request.request_id):
        g.aborted = True


def _unless_aborted(groups: list[Group], control: Control) -> list[Group]:
    """The groups whose request was not aborted; the others end "abort" here."""
    out = []
    for g in groups:
        if control.is_aborted(g.request.request_id):
            g.aborted = True
        else:
            out.append(g)
    return out


def _fire(boundary: str, g: Group) -> None:
    for hook in hooks:
        hook(boundary, g.request.request_id)


def _generation(engine: Engine) -> int:
    with engine.gate:
        return engine.gate.generation


def _submit_wait(
    engine: Engine,
    groups: list[Group],
    stage: int,
    deadline: float | None,
    refuse: bool,
    control: Control,
) -> list[GenerateResult]:
    """The groups' `stage` requests through engine.generate_many; while generation is paused,
    the first stage of a request is refused as any request is (`refuse`), a later one waits
    for the resume."""
    if not groups:
        return []
    reqs = [g.stage_request(stage) for g in groups]
    owners = {r.request_id: g.request.request_id for r, g in zip(reqs, groups, strict=True)}
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise GenerateTimeout("the multi-stage request did not finish in time")
        if control.cancelled:
            raise Cancelled("the multi-stage request was cancelled")
        try:
            return engine.generate_many(
                reqs, left, on_queued=lambda _: control.queued(engine, owners)
            )
        except Paused:
            if refuse:
                raise
            with engine.gate:
                engine.gate.wait_for(lambda: not engine.gate.is_paused, left)
        finally:
            control.ended(list(owners))


class Cancelled(Exception):
    """The handler that ran it was cancelled (its client went away)."""
