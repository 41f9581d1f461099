"""Gate: the engine's one lock, and every flag that a refusal or a wait reads.

Flags: the pause mode, the open exclusive sections, whether the worker computes a step (it
does so without the lock) or is stopping, whether it was started and still runs, the memory
tags released, and what the weights side last said of the weights: the label each step
records, a description of their mix of labels, one of the tensors a failed copy left torn, and
a generation that every write moves; and whether the catalog that goes with the weights is
served (a sync that carries one: `catalog_pending` while a session holds it, `catalog_fault`
when it failed after the weights were written). A mix, torn tensors and a catalog fault refuse
alike: generation 503, /continue_generation 409 (the server stays paused), /ready 503. The rest
of the engine's shared state (queues, results) is read and written holding the gate (`with
gate:`), so every check and the act it allows are one step under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from grctl.errors import (
    GrctlError,
    MemoryReleased,
    NotReady,
    Paused,
    PauseTimeout,
    WeightsDiscarded,
    WeightsInconsistent,
    WeightsInconsistentConflict,
    WeightsMixed,
    WeightsMixedConflict,
)

_RETRY_ELSEWHERE = "retry on another server"
_WORKER_DEAD = "the engine's worker thread has stopped; no request would run"
_RESTART = "restart the server (its log says why the worker ended)"
_RETRY_RESUMED = "retry after /continue_generation"
_REWRITE_TORN = (
    "write those tensors again (push them, or the whole checkpoint); a relabel does not clear this"
)

Refusal = tuple[str, Callable[[], GrctlError]]  # (the /ready reason, a maker of the error)

PAUSE_MODES = ("abort", "retract", "in_place")  # what pause_mode holds while paused


def mode_done(mode: str) -> str:
    return {"abort": "aborted", "retract": "retracted"}.get(mode, "frozen")


class Gate:
    def __init__(self, label: str, allow_mixed: bool = False):
        self._cond = threading.Condition()
        self.pause_mode: str | None = None
        self.num_exclusive = 0  # open sections (a weight write, a memory move): no step starts
        self.is_computing = False
        self.is_stopping = False
        self.worker_started = False
        self.worker_alive = False
        self.released: frozenset[str] = frozenset()  # memory tags (memory.py)
        self.label = str(label)
        self.mix: str | None = None  # the weights side's description of a mix; None: one label
        self.torn: str | None = None  # its description of the torn tensors; None: none is
        # its description of the tensors a memory release discarded, until they are written
        # again: generation is refused, but not a resume (the trainer pushes after it)
        self.discarded: str | None = None
        self.generation = 0  # moves with every weight write: cached KV of older ones is stale
        # a weight update session holds the catalog of its weights: nothing computes until its
        # end installs both; a description of it, or None
        self.catalog_pending: str | None = None
        self.catalog_fault: str | None = None  # why the weights' catalog is not served
        self.allow_mixed = allow_mixed  # --allow-partial-updates: a mix is served

    # ---- the lock -----------------------------------------------------------------------
    def __enter__(self) -> Gate:
        self._cond.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._cond.release()

    def wait_for(self, predicate: Callable[[], object], timeout: float | None = None) -> bool:
        """Wait, holding the gate, until `predicate()` (read under it) is true or time is up."""
        return bool(self._cond.wait_for(predicate, timeout))

    def notify(self) -> None:
        self._cond.notify_all()

    # ---- what the flags allow -----------------------------------------------------------
    @property
    def is_paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def is_mixed(self) -> bool:
        """Mixed labels refuse service, unless partial weight updates are allowed."""
        return self.mix is not None and not self.allow_mixed

    @property
    def is_consistent(self) -> bool:
        """No tensor is torn (torn ones refuse service whatever --allow-partial-updates says)."""
        return self.torn is None

    def can_progress(self) -> bool:
        return (
            not self.is_paused
            and self.is_consistent
            and self.discarded is None
            and not self.released
            and not self.is_mixed
            and self.catalog_fault is None
            and self.catalog_pending is None
        )

    def can_compute(self) -> bool:
        return self.can_progress() and not (
            self.num_exclusive or self.is_computing or self.is_stopping
        )

    def refusals(self) -> list[Refusal]:
        """Why generation is refused now, the most decisive first. One list, so /ready and
        submit never disagree."""
        out: list[Refusal] = []
        if self.is_stopping:
            out.append(
                ("stopping", lambda: NotReady("the engine is stopping", hint=_RETRY_ELSEWHERE))
            )
        if self.worker_started and not self.worker_alive:
            out.append(("worker_not_running", lambda: NotReady(_WORKER_DEAD, hint=_RESTART)))
        if self.is_mixed:  # before paused: resuming will not help until it clears
            out.append(("weights_mixed", self.mixed_error))
        if not self.is_consistent:  # the same
            out.append(("weights_inconsistent", self.torn_error))
        if self.catalog_fault is not None:  # the same
            out.append(("catalog_inconsistent", self.catalog_error))
        if self.discarded is not None:
            out.append(("weights_discarded", self.discarded_error))
        if self.catalog_pending is not None:
            out.append(("catalog_pending", self.pending_error))
        if self.is_paused:
            out.append(("paused", lambda: Paused("generation is paused", hint=_RETRY_RESUMED)))
        if self.released:
            out.append(("memory_released", lambda: self.memory_error("generation is refused")))
        return out

    def mixed_error(self, cls: type[WeightsMixed] = WeightsMixed) -> WeightsMixed:
        return cls(
            f"the weights are mixed (a weight sync stopped part-way): {self.mix}",
            hint="send the rest of the update (or push the whole checkpoint again), or relabel "
            "with /update_weight_version if the mix is intended",
        )

    def torn_error(
        self, cls: type[WeightsInconsistent] = WeightsInconsistent
    ) -> WeightsInconsistent:
        return cls(f"the weights are not whole: {self.torn}", hint=_REWRITE_TORN)

    def discarded_error(self) -> WeightsDiscarded:
        return WeightsDiscarded(
            f"the weights are not served: {self.discarded}",
            hint="push the weights (the whole checkpoint) after /resume_memory_occupation, or "
            "serve with --enable-weights-cpu-backup to keep a host copy",
        )

    def catalog_error(
        self, cls: type[WeightsInconsistent] = WeightsInconsistent
    ) -> WeightsInconsistent:
        return cls(
            f"the catalog that goes with the served weights is not served: {self.catalog_fault}",
            hint="sync again with its catalog_path, or POST /catalog/reload the catalog of "
            "these weights",
        )

    def pending_error(self) -> Paused:
        return Paused(
            f"a weight update session carries the catalog of its weights ({self.catalog_pending})"
            ": nothing is served until /end_weight_update installs both",
            hint="retry after /end_weight_update",
        )

    def memory_error(self, what: str) -> MemoryReleased:
        return MemoryReleased(
            f"memory is released ({', '.join(sorted(self.released))}): {what}",
            hint="POST /resume_memory_occupation (tags null: all) first",
        )

    # ---- the waits ----------------------------------------------------------------------
    def pause(self, mode: str, timeout: float) -> None:
        """From here no step starts; wait up to `timeout` for the running one to end."""
        with self._cond:
            self.pause_mode = mode
            if not self._cond.wait_for(lambda: not self.is_computing, timeout):
                raise PauseTimeout(
                    f"paused, but the running step did not end within {timeout:g} s, so its "
                    f"requests are not {mode_done(mode)} yet",
                    hint="retry /pause_generation; if it keeps failing the engine is stuck: "
                    "restart the server",
                )

    def resume(self) -> None:
        """Leave the pause; refused (409, still paused) while the weights are mixed or torn."""
        with self._cond:
            if self.is_mixed:
                raise self.mixed_error(WeightsMixedConflict)
            if not self.is_consistent:
                raise self.torn_error(WeightsInconsistentConflict)
            if self.catalog_fault is not None:
                raise self.catalog_error(WeightsInconsistentConflict)
            self.pause_mode = None
            self._cond.notify_all()

    def enter_exclusive(self) -> None:
        """Open an exclusive section: no step starts until it closes; the running one ends."""
        with self._cond:
            self.num_exclusive += 1
            self._cond.wait_for(lambda: not self.is_computing)

    def leave_exclusive(self) -> None:
        with self._cond:
            self.num_exclusive -= 1
            self._cond.notify_all()

    # ---- what the worker and the weights side tell it -----------------------------------
    def worker_running(self, alive: bool) -> None:
        with self._cond:
            if alive:
                self.worker_started, self.is_stopping = True, False
            self.worker_alive = alive
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.is_stopping = True
            self._cond.notify_all()

    def begin_step(self) -> None:
        """The worker takes a step's batch and computes it without the lock."""
        with self._cond:
            self.is_computing = True

    def end_step(self) -> None:
        with self._cond:
            self.is_computing = False
            self._cond.notify_all()

    def weights_written(
        self, label: str | None, mix: str | None, torn: str | None, discarded: str | None = None
    ) -> None:
        """The weights were written: a new generation; `label` None keeps the label."""
        with self._cond:
            self.generation += 1
            self.torn, self.discarded = torn, discarded
            self.relabel(self.label if label is None else label, mix)

    def relabel(self, label: str, mix: str | None) -> None:
        """A new label (and mix); torn tensors stay torn."""
        with self._cond:
            self.label, self.mix = str(label), mix
            self._cond.notify_all()

    def set_released(self, tags: frozenset[str]) -> None:
        with self._cond:
            self.released = tags
            self._cond.notify_all()
