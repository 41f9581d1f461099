"""Engine: the generation API the server calls, over a background worker doing continuous batching.

One condition variable guards every piece of shared state (queues, results, pause, exclusive, the
weights' state). The worker takes a step's batch under it, computes without it (`_computing` is
set meanwhile), and publishes the step's outcome under it again. Whatever needs the model quiet
(pause, exclusive, flush) waits on the same condition for `_computing` to clear, so each decision
is made under one lock with no check-then-act race.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from grctl.engine.executor import Executor
from grctl.engine.model_runner import ModelRunner
from grctl.engine.prefill_cache import PrefillCache
from grctl.engine.qwen3 import Qwen3ForCausalLM
from grctl.engine.request import GenerateRequest, GenerateResult
from grctl.engine.results import ResultStore
from grctl.engine.scheduler import Scheduler
from grctl.engine.sequence import Sequence, Status
from grctl.engine.stats import EngineStats
from grctl.engine.validation import stop_ids_of, validate_request
from grctl.errors import (
    Conflict,
    DuplicateRequestId,
    GenerateTimeout,
    NotFound,
    NotReady,
    Overloaded,
    Paused,
    ValidationError,
    WeightsInconsistent,
)

log = logging.getLogger("grctl.engine")
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    max_context_len: int = 8192
    max_running_requests: int = 64
    max_waiting_requests: int = 1024
    prefill_token_budget: int = 8192
    max_beam_width: int = 256
    max_new_tokens_limit: int = 64
    enable_prefill_cache: bool = False
    prefill_cache_max_entries: int = 64
    prefill_cache_max_tokens: int = 262144
    use_cuda_graph: bool = True
    max_finished_results: int = 10_000


class Engine:
    def __init__(
        self, model: Qwen3ForCausalLM, config: EngineConfig, weight_version: str = "default"
    ):
        self.device = torch.device(config.device)
        if model.embed_tokens.weight.device != self.device:
            model.to(self.device)  # at construction only: later, weights are written in place
        self.model = model.eval()
        self.config = config
        self.weight_version = weight_version
        self.pause_mode: str | None = None
        self.cache = PrefillCache(
            config.enable_prefill_cache,
            config.prefill_cache_max_entries,
            config.prefill_cache_max_tokens,
        )
        self.runner = ModelRunner(model, self.device)
        self.executor = Executor(self.runner, self.cache)
        self.scheduler = Scheduler(config.max_running_requests, config.prefill_token_budget)
        self.results = ResultStore(config.max_finished_results)
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._seqs: dict[str, Sequence] = {}  # in flight: waiting or running
        self._step_ids: set[str] = set()  # the requests of the step being computed
        self._computing = False
        self._exclusive = 0
        self._weights_consistent = True
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
        if self.config.use_cuda_graph and self.device.type == "cuda" and self.runner.graphs is None:
            from grctl.engine.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.model, self.device, self.config.max_beam_width)
        self._thread = threading.Thread(target=self._worker, name="grctl-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            if drain and self.is_worker_alive:  # while paused nothing could finish: no wait
                self._cond.wait_for(lambda: not self._seqs or not self._can_progress(), timeout)
            self._stopping = True
            self._abort_all_locked()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def is_worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _worker(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._has_work(), timeout=1.0)
                if self._stopping:
                    return
            try:
                if not self.run_step():
                    time.sleep(0.001)
            except Exception as exc:  # a bug outside the model step: keep serving
                log.exception("engine worker step failed")
                self.stats.record_error(exc)

    # ---- requests -----------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> str:
        cfg = self.config
        validate_request(
            req,
            self.model.config,
            max_context_len=cfg.max_context_len,
            max_beam_width=cfg.max_beam_width,
            max_new_tokens_limit=cfg.max_new_tokens_limit,
        )
        with self._cond:
            if self._stopping:
                raise NotReady("the engine is stopping", hint="retry on another server")
            if self.pause_mode is not None:
                raise Paused("generation is paused", hint="retry after /continue_generation")
            if not self._weights_consistent:
                raise WeightsInconsistent(
                    "a weight update failed part-way; generation is refused",
                    hint="push a complete weight update",
                )
            rid = req.request_id or self.stats.new_request_id()
            if rid in self._seqs or rid in self.results:
                raise DuplicateRequestId(f"request id {rid!r} is already in use")
            if len(self.scheduler.waiting) >= cfg.max_waiting_requests:
                raise Overloaded(
                    f"the waiting queue is full ({cfg.max_waiting_requests} requests)",
                    hint="retry later",
                )
            seq = Sequence(rid, req, stop_ids_of(req, self.model.config))
            self._seqs[rid] = seq
            self.scheduler.add(seq)
            self.stats.num_submitted += 1
            self._cond.notify_all()
        return rid

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
        rid = self.submit(req)
        try:
            return self.result(rid, timeout)
        except GenerateTimeout:
            with self._cond:
                if self._cancel_locked(rid):
                    self._cond.wait_for(lambda: rid not in self._seqs, 5.0)
                self.results.pop(rid)
            raise

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
        with self._cond:
            self.pause_mode = mode
            self._cond.wait_for(lambda: not self._computing)
            if mode == "abort":
                return self._abort_all_locked()
            if mode == "retract":
                self.scheduler.retract_running()
            return 0

    def resume(self) -> None:
        with self._cond:
            self.pause_mode = None
            self._cond.notify_all()

    @property
    def is_paused(self) -> bool:
        return self.pause_mode is not None

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
            self._exclusive += 1
            self._cond.wait_for(lambda: not self._computing)
            num_aborted = self._abort_all_locked() if abort_all_requests else 0
        try:
            yield num_aborted
        finally:
            with self._cond:
                self._exclusive -= 1
                self._cond.notify_all()

    def set_weights_state(self, weight_version: str | None = None, consistent: bool = True) -> None:
        with self._cond:
            if weight_version is not None:
                self.weight_version = weight_version
            self._weights_consistent = consistent
            self._cond.notify_all()

    @property
    def is_weights_consistent(self) -> bool:
        return self._weights_consistent

    def flush_cache(self, timeout: float = 0.0) -> tuple[bool, int]:
        """Clear the prefill cache if no request holds KV or is computing (waits up to timeout)."""
        with self._cond:
            idle = self._cond.wait_for(
                lambda: not self._computing and not self.scheduler.running, timeout
            )
            return (True, self.cache.clear()) if idle else (False, 0)

    def clear_prefill_cache(self) -> int:
        return self.cache.clear()

    # ---- the step -----------------------------------------------------------------------
    def _can_progress(self) -> bool:
        return not self.is_paused and self._weights_consistent

    def _can_compute(self) -> bool:
        return self._can_progress() and not (self._exclusive or self._computing or self._stopping)

    def _has_work(self) -> bool:
        return self._can_compute() and bool(self._seqs)

    def run_step(self) -> bool:
        """One step: admit and prefill, then decode every running request. Returns False when
        there was nothing to do. The worker calls it; tests may call it without starting one."""
        with self._cond:
            if not self._can_compute():
                return False
            prefill, decode = self.scheduler.schedule()
            step = prefill + decode
            if not step:
                return False
            self._computing = True
            self._step_ids = {s.request_id for s in step}
            version = self.weight_version
        t0, error = time.perf_counter(), None
        try:
            self.executor.run(prefill, decode, version)
        except Exception as exc:
            log.exception("engine step failed; its requests end with finish_reason abort")
            error = exc
        with self._cond:
            self._computing = False
            self._step_ids = set()
            self.stats.record_step(time.perf_counter() - t0, error)
            for seq in step:
                if seq.status is not Status.FINISHED and (
                    error is not None or seq.abort_requested or seq.is_done
                ):
                    self._finish_locked(seq, aborted=error is not None or seq.abort_requested)
            self._cond.notify_all()
        return True

    def _abort_locked(self, seq: Sequence) -> None:
        if self._computing and seq.request_id in self._step_ids:
            seq.abort_requested = True  # the worker ends it when the step's outcome lands
        else:
            self._finish_locked(seq, aborted=True)

    def _abort_all_locked(self) -> int:
        seqs = self.scheduler.all_sequences()
        for seq in seqs:
            self._abort_locked(seq)
        self._cond.notify_all()
        return len(seqs)

    def _finish_locked(self, seq: Sequence, aborted: bool = False) -> None:
        self.scheduler.remove(seq)
        del self._seqs[seq.request_id]
        seq.release_kv()
        result = seq.to_result(self.weight_version, aborted)
        self.results.put(result)
        self.stats.record_result(result)

    # ---- introspection ------------------------------------------------------------------
    def ready_reasons(self) -> list[str]:
        with self._cond:
            reasons = []
            if self.is_paused:
                reasons.append("paused")
            if not self._weights_consistent:
                reasons.append("weights_inconsistent")
            if not self.is_worker_alive:
                reasons.append("worker_not_running")
            if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
                reasons.append("waiting_queue_full")
            return reasons

    def status(self) -> dict:
        with self._cond:
            return self.stats.status(self)
