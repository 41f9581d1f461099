"""Engine: the generation API the server calls, over a background worker doing continuous batching.

Requests are submitted, polled, fetched and cancelled here; pause, the exclusive section of a
weight update and the cache flush are decided here, each under the core's one lock (core.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from grctl.engine import memory
from grctl.engine.kv_cache import request_kv_bytes
from grctl.engine.request import GenerateRequest, GenerateResult
from grctl.engine.sequence import Sequence
from grctl.engine.validation import stop_ids_of, validate_request
from grctl.engine.worker import EngineCore
from grctl.errors import (
    Conflict,
    DuplicateRequestId,
    GenerateTimeout,
    GrctlError,
    NotFound,
    NotReady,
    Overloaded,
    Paused,
    PauseTimeout,
    ValidationError,
    WeightsInconsistent,
    WeightsMixed,
    WeightsMixedConflict,
)

PAUSE_MODES = ("abort", "retract", "in_place")
_RETRY_ELSEWHERE = "retry on another server"
_WORKER_DEAD = "the engine's worker thread has stopped; no request would run"
_RESTART = "restart the server (its log says why the worker ended)"
_RETRY_RESUMED = "retry after /continue_generation"
_INCONSISTENT = "a weight update failed part-way; generation is refused"
_PUSH_ALL = "push a complete weight update"


def mode_done(mode: str) -> str:
    return {"abort": "aborted", "retract": "retracted"}.get(mode, "frozen")


class Engine(EngineCore):
    """The API the server calls. `run_step()` (from the core) advances one step by hand when no
    worker is started, which tests use to reach every state deterministically."""

    # ---- requests -----------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> str:
        cfg = self.config
        validate_request(
            req,
            self.model.config,
            max_context_len=cfg.max_context_len,
            max_beam_width=cfg.max_beam_width,
            max_new_tokens_limit=cfg.max_new_tokens,
        )
        self._check_kv_fits(req)
        with self._cond:
            refusals = self._refusals_locked()
            if refusals:
                raise refusals[0][1]()
            rid = req.request_id or self.stats.new_request_id()
            if rid in self._seqs or rid in self.results:
                raise DuplicateRequestId(f"request id {rid!r} is already in use")
            if len(self.scheduler.waiting) >= cfg.max_waiting_requests:
                raise Overloaded(
                    f"the waiting queue is full ({cfg.max_waiting_requests} requests)",
                    hint="retry later",
                )
            store = self.catalogs
            catalog = store.current if store is not None and req.sampling.use_catalog else None
            seq = Sequence(rid, req, stop_ids_of(req, self.model.config), catalog)
            self._seqs[rid] = seq
            self.scheduler.add(seq)
            self.stats.num_submitted += 1
            self._cond.notify_all()
        return rid

    def _refusals_locked(self) -> list[tuple[str, Callable[[], GrctlError]]]:
        """Why generation is refused now, the most decisive first: (the /ready reason, a maker
        of the error submit raises). One list, so /ready and submit never disagree."""
        out: list[tuple[str, Callable[[], GrctlError]]] = []
        if self._stopping:
            out.append(
                ("stopping", lambda: NotReady("the engine is stopping", hint=_RETRY_ELSEWHERE))
            )
        if self._thread is not None and not self._thread.is_alive():  # started, then died
            out.append(("worker_not_running", lambda: NotReady(_WORKER_DEAD, hint=_RESTART)))
        if self.is_weights_mixed:  # before paused: resuming will not help until it clears
            out.append(("weights_mixed", self.mixed_error))
        if self.is_paused:
            out.append(("paused", lambda: Paused("generation is paused", hint=_RETRY_RESUMED)))
        if self.memory.released:
            out.append(("memory_released", lambda: self.memory.error("generation is refused")))
        if not self._weights_consistent:
            out.append(
                ("weights_inconsistent", lambda: WeightsInconsistent(_INCONSISTENT, hint=_PUSH_ALL))
            )
        return out

    def _check_kv_fits(self, req: GenerateRequest) -> None:
        """A request whose KV alone exceeds the budget could never be admitted: refuse it now."""
        if self.kv_bytes_budget is None:
            return
        sp = req.sampling
        itemsize = self.model.embed_tokens.weight.element_size()
        need = request_kv_bytes(
            self.model.config, itemsize, len(req.input_ids), sp.n, sp.max_new_tokens
        )
        if need > self.kv_bytes_budget:
            raise ValidationError(
                f"the request needs {need} bytes of KV ({len(req.input_ids)} prompt tokens, "
                f"{sp.n} beams), more than the server's KV budget of {self.kv_bytes_budget}",
                hint="shorten the prompt or the beam width, or start the server with a larger "
                "--max-kv-bytes",
            )

    def poll(self, request_id: str) -> GenerateResult | None:
        with self._cond:
            result = self.results.peek(request_id)
            if result is None and request_id not in self._seqs:
                raise NotFound(f"no request {request_id!r}", hint="results are kept until fetched")
            return result

    def result(self, request_id: str, timeout: float | None = None) -> GenerateResult:
        with self._cond:
            self._cond.wait_for(
                lambda: request_id in self.results or request_id not in self._seqs, timeout
            )
            result = self.results.pop(request_id)
            if result is not None:
                return result
            if request_id in self._seqs:
                raise GenerateTimeout(f"request {request_id!r} did not finish in {timeout}s")
            raise NotFound(f"no request {request_id!r}", hint="results are kept until fetched")

    def generate(self, req: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        """submit + result; on timeout the request is cancelled and its result dropped."""
        return self.generate_many([req], timeout)[0]

    def generate_many(
        self, reqs: list[GenerateRequest], timeout: float | None = None
    ) -> list[GenerateResult]:
        """Submit every request (all or none), then wait for each: one scheduler batch. On a
        timeout (for the whole batch) or any error, the unfinished ones are cancelled."""
        rids: list[str] = []
        results: list[GenerateResult] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for req in reqs:
                rids.append(self.submit(req))
            for rid in rids:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                results.append(self.result(rid, left))
        except BaseException:
            self.discard(rids[len(results) :])
            raise
        return results

    def discard(self, request_ids: list[str]) -> None:
        """Cancel requests and drop their results, as if they had never been submitted."""
        with self._cond:
            for rid in request_ids:
                self._cancel_locked(rid)
            self._cond.wait_for(lambda: not any(r in self._seqs for r in request_ids), 5.0)
            for rid in request_ids:
                self.results.pop(rid)

    def cancel(self, request_id: str) -> bool:
        with self._cond:
            return self._cancel_locked(request_id)

    def _cancel_locked(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._abort_locked(seq)
        self._cond.notify_all()
        return True

    def abort_all(self) -> int:
        with self._cond:
            return self._abort_all_locked()

    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._seqs)

    # ---- pause, weights, cache ----------------------------------------------------------
    def pause(self, mode: str = "abort") -> int:
        """Stop computing. abort: end every in-flight request (returns how many); retract: drop
        running requests' KV and queue them again from their prompt; in_place: freeze them."""
        if mode not in PAUSE_MODES:
            raise ValidationError(f"pause mode must be one of {', '.join(PAUSE_MODES)}")
        timeout = self.config.pause_timeout_s
        with self._cond:
            self.pause_mode = mode  # from here no new step starts
            if not self._cond.wait_for(lambda: not self._computing, timeout):
                raise PauseTimeout(
                    f"paused, but the running step did not end within {timeout:g} s, so its "
                    f"requests are not {mode_done(mode)} yet",
                    hint="retry /pause_generation; if it keeps failing the engine is stuck: "
                    "restart the server",
                )
            if mode == "abort":
                return self._abort_all_locked()
            if mode == "retract":
                self.scheduler.retract_running()
            return 0

    def resume(self) -> None:
        """Leave the pause; refused (409, still paused) while the weights are mixed."""
        with self._cond:
            if self.is_weights_mixed:
                raise self.mixed_error(WeightsMixedConflict)
            self.pause_mode = None
            self._cond.notify_all()

    def mixed_error(self, cls: type[WeightsMixed] = WeightsMixed) -> WeightsMixed:
        return cls(
            f"the weights are mixed (a weight sync stopped part-way): "
            f"{self.versions.describe_mix()}",
            hint="send the rest of the update (or push the whole checkpoint again), or relabel "
            "with /update_weight_version if the mix is intended",
        )

    @contextmanager
    def exclusive(self, abort_all_requests: bool = False) -> Iterator[int]:
        """No model step runs inside (submits still queue). Yields the number aborted."""
        with self._cond:
            if self._seqs and not self.is_paused and not abort_all_requests:
                raise Conflict(
                    "requests are in flight",
                    hint="call /pause_generation first (mode=abort) "
                    "or pass abort_all_requests=true",
                )
            if self.memory.is_released("weights"):
                raise self.memory.error("the weights cannot be written")
            self._exclusive += 1
            self._cond.wait_for(lambda: not self._computing)
            num_aborted = self._abort_all_locked() if abort_all_requests else 0
        try:
            yield num_aborted
        finally:
            with self._cond:
                self._exclusive -= 1
                self._cond.notify_all()

    def set_weights_state(self, consistent: bool = True) -> None:
        """After a weight write that moves no label (a failed copy, a reset)."""
        with self._cond:
            self._weights_written_locked(consistent)

    def record_weights(self, names: Iterable[str], label: str | None, **kw) -> None:
        """After a successful weight write: the written tensors' labels (WeightVersions.record)
        and the weights' state move together, under the lock a step reads them under."""
        with self._cond:
            self.versions.record(names, label, **kw)
            self._weights_written_locked(consistent=True)

    def _weights_written_locked(self, consistent: bool) -> None:
        self.weights_generation += 1  # the weights were written: no cached KV is current
        self.cache.drop_entries()  # so drop it now, not entry by entry on lookup
        self._weights_consistent = consistent
        self._cond.notify_all()

    def relabel_weights(self, label: str, abort_all_requests: bool = False) -> int:
        """Every tensor takes `label`; running requests go on (they report both versions)
        unless `abort_all_requests`. Returns the number aborted."""
        with self._cond:
            num_aborted = self._abort_all_locked() if abort_all_requests else 0
            self.versions.relabel(label)
            self._cond.notify_all()
            return num_aborted

    def flush_cache(self, timeout: float = 0.0) -> tuple[bool, int]:
        """Clear the prefill cache if no request holds KV or is computing (waits up to timeout)."""
        with self._cond:
            idle = self._cond.wait_for(
                lambda: not self._computing and not self.scheduler.running, timeout
            )
            return (True, self.cache.clear()) if idle else (False, 0)

    # ---- memory (verl's colocated rollout) ----------------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> list[str]:
        """Free device memory by tag (memory.py); generation is refused until all are back."""
        return self._move_memory(self.memory.release, tags, needs_idle=True)

    def resume_memory(self, tags: list[str] | None = None) -> list[str]:
        return self._move_memory(self.memory.resume, tags, needs_idle=False)

    def _move_memory(self, move, tags: list[str] | None, needs_idle: bool) -> list[str]:
        tags = memory.check_tags(tags)
        with self._memory_lock:  # one release or resume at a time
            with self._cond:
                if needs_idle and (self._seqs or self._exclusive):
                    raise Conflict(
                        "requests are in flight or a weight update runs; memory stays occupied",
                        hint="wait for them, or POST /pause_generation (mode abort) first",
                    )
                self._exclusive += 1  # no step and no update starts while memory moves
            try:
                move(self, tags)
            finally:
                with self._cond:
                    self._exclusive -= 1
                    self._cond.notify_all()
            return sorted(self.memory.released)

    def clear_prefill_cache(self) -> int:
        return self.cache.clear()

    # ---- introspection ------------------------------------------------------------------
    def ready_reasons(self) -> list[str]:
        with self._cond:
            reasons = [reason for reason, _ in self._refusals_locked()]
            if self._thread is None:  # never started (a died worker is among the refusals)
                reasons.append("worker_not_running")
            if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
                reasons.append("waiting_queue_full")
            return reasons

    def status(self) -> dict:
        with self._cond:
            return self.stats.status(self)
