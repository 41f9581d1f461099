"""EngineCore: the engine's shared state, its one lock, and the background worker's step.

One condition variable guards every piece of shared state (queues, results, pause, exclusive, the
weights' state). The worker takes a step's batch under it, computes without it (`_computing` is
set meanwhile), and publishes the step's outcome under it again. Whatever needs the model quiet
(pause, exclusive, flush) waits on the same condition for `_computing` to clear, so each decision
is made under one lock with no check-then-act race. The public API is `Engine` (engine.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from grctl.engine.executor import Executor
from grctl.engine.kv_cache import request_kv_bytes
from grctl.engine.memory import MemorySaver
from grctl.engine.model_runner import ModelRunner
from grctl.engine.prefill_cache import PrefillCache
from grctl.engine.results import ResultStore
from grctl.engine.scheduler import Scheduler
from grctl.engine.sequence import Sequence, Status
from grctl.engine.stats import EngineStats
from grctl.model.device import bind_thread
from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.weights.versions import WeightVersions

if TYPE_CHECKING:
    from grctl.catalog.store import CatalogStore
    from grctl.engine.config import EngineConfig

log = logging.getLogger("grctl.engine")


def kv_bytes_budget(config: EngineConfig, device: torch.device) -> int | None:
    """--max-kv-bytes, else a share of the GPU memory free now (the weights are loaded); None
    (no limit) on the CPU."""
    if config.max_kv_bytes:
        return config.max_kv_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.kv_memory_fraction)
    return None


class EngineCore:
    def __init__(self, model: Qwen3ForCausalLM, config: EngineConfig):
        # device "auto": wherever the model already is
        self.device = model.embed_tokens.weight.device
        if config.device != "auto":
            self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:N"
            self.device = torch.device("cuda", torch.cuda.current_device())
        if model.embed_tokens.weight.device != self.device:
            model.to(self.device)  # at construction only: later, weights are written in place
        self.model = model.eval()
        self.config = config
        self.versions = WeightVersions(model.config, config.weight_version)  # the labels' one owner
        self.weights_generation = 0  # grows with every weight write (see set_weights_state)
        self.pause_mode: str | None = None
        self.cache = PrefillCache(
            config.enable_prefill_cache,
            config.prefill_cache_max_entries,
            config.prefill_cache_max_tokens,
            config.prefill_cache_max_bytes,
        )
        self.runner = ModelRunner(model, self.device)
        self.executor = Executor(self.runner, self.cache)
        self.kv_bytes_budget = kv_bytes_budget(config, self.device)
        self.scheduler = Scheduler(
            config.max_running_requests,
            config.prefill_token_budget,
            self.kv_bytes_budget,
            self.kv_bytes_of,
        )
        self.results = ResultStore(config.max_finished_results)
        self.stats = EngineStats()
        self.catalogs: CatalogStore | None = None  # requests are held to its current catalog
        self.memory = MemorySaver()
        self._memory_lock = threading.Lock()  # one release/resume at a time
        self._cond = threading.Condition()
        self._seqs: dict[str, Sequence] = {}  # in flight: waiting or running
        self._step_ids: set[str] = set()  # the requests of the step being computed
        self._computing = False
        self._exclusive = 0
        self._weights_consistent = True
        self._thread: threading.Thread | None = None
        self._stopping = False

    def kv_bytes_of(self, seq: Sequence) -> int:
        sp = seq.req.sampling
        itemsize = self.model.embed_tokens.weight.element_size()
        return request_kv_bytes(
            self.model.config, itemsize, seq.num_prompt_tokens, sp.n, sp.max_new_tokens
        )

    @property
    def is_paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def is_weights_consistent(self) -> bool:
        return self._weights_consistent

    @property
    def weight_version(self) -> str:
        return self.versions.current

    @property
    def is_weights_mixed(self) -> bool:
        """Mixed labels refuse service, unless partial weight updates are allowed."""
        return self.versions.is_mixed and not self.config.allow_partial_updates

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
        if self.config.cuda_graph and self.device.type == "cuda" and self.runner.graphs is None:
            self._capture_graphs()
        self._thread = threading.Thread(target=self._worker, name="grctl-engine", daemon=True)
        self._thread.start()

    def _capture_graphs(self) -> None:
        from grctl.engine.cuda_graphs import DecodeGraphs

        try:
            bind_thread(self.device)  # the capture stream and pool belong to the model's device
            self.runner.graphs = DecodeGraphs(self.model, self.device)
        except Exception as exc:  # serve eagerly rather than not at all
            log.exception("CUDA graph capture failed; decode runs eagerly")
            self.stats.record_error(exc)

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
        bind_thread(self.device)  # a new thread starts on cuda:0 whatever the model's device
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

    # ---- the step -----------------------------------------------------------------------
    def _can_progress(self) -> bool:
        return (
            not self.is_paused
            and self._weights_consistent
            and not self.memory.released
            and not self.is_weights_mixed
        )

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
            # Cache entries are tagged by update, not by label: a relabel-free update must not
            # reuse KV computed with the old weights.
            cache_tag = f"{version}#{self.weights_generation}"
        t0, error = time.perf_counter(), None
        try:
            self.executor.run(prefill, decode, version, cache_tag)
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
