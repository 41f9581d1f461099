"""/status of the engine: the scheduler's queues and budgets, the request counters, the prefix
cache, and the engine's device, weights state, graphs, memory and errors, read under its gate."""

from __future__ import annotations

import time

from grctl.model.dtypes import name_of


def snapshot(engine) -> dict:
    """/status of an Engine (engine.py imports this module: no import back), less "weights"
    and "catalog" (their owners report them)."""
    cfg, gate, stats = engine.config, engine.gate, engine.stats
    with gate:
        graphs = engine.runner.graphs
        return {
            "scheduler": {
                **engine.scheduler.stats(),
                "finished": stats.num_finished,
                "retained_results": len(engine.results),
                "evicted_results": engine.results.num_evicted,
                "retained_result_bytes": engine.results.nbytes,
                "paused": gate.is_paused,
                "pause_mode": gate.pause_mode,
                "steps": stats.num_steps,
                **engine.executor.stats(),
                "avg_step_ms": stats.avg_step_ms,
                "last_step_ms": stats.last_step_ms,
                "max_running_requests": cfg.max_running_requests,
                "max_waiting_requests": cfg.max_waiting_requests,
                "prefill_token_budget": cfg.prefill_token_budget,
            },
            "requests": stats.requests(),
            "prefill_cache": engine.cache.stats(),
            "engine": {
                "device": str(engine.device),
                "dtype": name_of(engine.runner.dtype),
                "worker_alive": gate.worker_alive,
                "weight_version": gate.label,
                "weights_consistent": gate.is_consistent,
                "cuda_graph": graphs.stats() if graphs is not None else {"enabled": False},
                "memory": engine.memory.stats(),
                "errors": stats.num_errors,
                "last_error": stats.last_error,
                "uptime_s": time.time() - stats.started_at,
            },
        }
