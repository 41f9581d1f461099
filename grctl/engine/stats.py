"""EngineStats: the engine's request and step counters (read by /status and /metrics)."""

from __future__ import annotations

import time

from grctl.engine.request import GenerateResult


class EngineStats:
    def __init__(self):
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

    def requests(self) -> dict:
        """/status "requests"."""
        return {
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
        }

    @property
    def avg_step_ms(self) -> float:
        return 1000.0 * self.step_s_sum / max(self.num_steps, 1)
