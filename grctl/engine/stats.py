"""EngineStats: the engine's counters (read by /status and /metrics) and its status() dict."""

from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import TYPE_CHECKING

from grctl.engine.request import GenerateResult
from grctl.model.dtypes import name_of

if TYPE_CHECKING:
    from grctl.engine.engine import Engine


class EngineStats:
    def __init__(self):
        self._ids = itertools.count()
        self._id_prefix = f"{uuid.uuid4().hex[:8]}-{os.getpid()}"
        self.started_at = time.time()
        self.num_submitted = 0
        self.num_finished = 0  # every result, aborted ones included
        self.num_succeeded = 0  # finish_reason length or stop
        self.num_aborted = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_generated_tokens = 0  # summed over beams
        self.latency_s_sum = 0.0
        self.latency_s_max = 0.0
        self.num_steps = 0
        self.step_s_sum = 0.0
        self.last_step_ms = 0.0
        self.num_errors = 0
        self.last_error: str | None = None

    def new_request_id(self) -> str:
        return f"req-{self._id_prefix}-{next(self._ids)}"

    def record_step(self, seconds: float, error: BaseException | None) -> None:
        self.num_steps += 1
        self.step_s_sum += seconds
        self.last_step_ms = seconds * 1000.0
        if error is not None:
            self.record_error(error)

    def record_error(self, error: BaseException) -> None:
        self.num_errors += 1
        self.last_error = f"{type(error).__name__}: {error}"

    def record_result(self, result: GenerateResult) -> None:
        self.num_finished += 1
        if result.finish_reason == "abort":
            self.num_aborted += 1
        else:
            self.num_succeeded += 1
        self.num_prompt_tokens += result.prompt_tokens
        self.num_cached_tokens += result.cached_tokens
        self.num_generated_tokens += result.completion_tokens
        self.latency_s_sum += result.latency_s
        self.latency_s_max = max(self.latency_s_max, result.latency_s)

    def status(self, engine: Engine) -> dict:
        """Called under the engine's lock."""
        sched, ex, cfg = engine.scheduler, engine.executor, engine.config
        num_waiting, num_running = len(sched.waiting), len(sched.running)
        graphs = engine.runner.graphs
        # The worker drops a finished request's KV without the lock (Executor._decode): read
        # each reference once, so a release between a check and the read is no AttributeError.
        kv = [(s.ctx, s.beam_kv) for s in list(sched.running)]
        return {
            "scheduler": {
                "running": num_running,
                "waiting": num_waiting,
                "num_running": num_running,
                "num_waiting": num_waiting,
                "running_beams": sum(s.num_beams for s in sched.running),
                "kv_bytes_budget": sched.kv_bytes_budget,  # null: no limit
                "kv_bytes_admitted": sched.kv_bytes_running(),
                # the context KV once per request, the decoded tail once per beam
                "context_kv_bytes": sum(c.nbytes for c, _ in kv if c is not None),
                "beam_kv_bytes": sum(b.nbytes for _, b in kv if b is not None),
                "finished": self.num_finished,
                "retained_results": len(engine.results),
                "evicted_results": engine.results.num_evicted,
                "paused": engine.is_paused,
                "pause_mode": engine.pause_mode,
                "steps": self.num_steps,
                "prefill_batches": ex.num_prefill_batches,
                "prefill_tokens": ex.num_prefill_tokens,
                "decode_steps": ex.num_decode_steps,
                "decode_rows": ex.num_decode_rows,
                "avg_step_ms": 1000.0 * self.step_s_sum / max(self.num_steps, 1),
                "last_step_ms": self.last_step_ms,
                "max_running_requests": cfg.max_running_requests,
                "max_waiting_requests": cfg.max_waiting_requests,
                "prefill_token_budget": cfg.prefill_token_budget,
            },
            "requests": {
                "submitted": self.num_submitted,
                "finished": self.num_finished,
                "succeeded": self.num_succeeded,
                "aborted": self.num_aborted,
                "prompt_tokens": self.num_prompt_tokens,
                "cached_tokens": self.num_cached_tokens,
                "generated_tokens": self.num_generated_tokens,
                "latency_s_sum": self.latency_s_sum,
                "latency_s_max": self.latency_s_max,
                "latency_s_avg": self.latency_s_sum / max(self.num_finished, 1),
            },
            "prefill_cache": engine.cache.stats(),
            "engine": {
                "device": str(engine.device),
                "dtype": name_of(engine.runner.dtype),
                "worker_alive": engine.is_worker_alive,
                "weight_version": engine.weight_version,
                "weights_consistent": engine.is_weights_consistent,
                "cuda_graph": graphs.stats() if graphs is not None else {"enabled": False},
                "memory": engine.memory.stats(),
                "errors": self.num_errors,
                "last_error": self.last_error,
                "uptime_s": time.time() - self.started_at,
            },
        }
