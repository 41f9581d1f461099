"""Prometheus text exposition: HTTP and generate counters and histograms, engine gauges.

A few dozen series, so a small registry here rather than a dependency. HTTP series are labelled
by route template (/poll/{request_id}, never the id), so their number stays bounded.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections import defaultdict

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from grctl.engine.request import GenerateResult
from grctl.errors import GrctlError

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
Labels = tuple[tuple[str, str], ...]


def fmt_labels(labels: Labels) -> str:
    if not labels:
        return ""
    esc = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, esc, strict=True)) + "}"


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str, labels: Labels) -> list[str]:
        out = [
            f"{name}_bucket{fmt_labels((*labels, ('le', str(b))))} {c}"
            for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        out.append(f"{name}_bucket{fmt_labels((*labels, ('le', '+Inf')))} {self.total}")
        out.append(f"{name}_sum{fmt_labels(labels)} {self.sum}")
        out.append(f"{name}_count{fmt_labels(labels)} {self.total}")
        return out


class Metrics:
    """Counters and histograms the server keeps; gauges are read from the engine when scraped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self.histograms: dict[str, dict[Labels, Histogram]] = defaultdict(dict)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        with self.lock:
            self.counters[name][tuple(sorted(labels.items()))] += value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self.lock:
            hist = self.histograms[name].get(key)
            if hist is None:
                hist = self.histograms[name][key] = Histogram()
            hist.observe(value)

    def observe_result(self, result: GenerateResult) -> None:
        """A result handed out over HTTP (/generate, /result): its end and engine latency."""
        self.inc("gr_generate_results_total", finish_reason=result.finish_reason)
        self.observe("gr_generate_latency_seconds", result.latency_s)

    def render(self, gauges: dict[str, float], counters: dict[str, float]) -> str:
        """This registry's series, then the engine's counters and gauges read at scrape time."""
        lines: list[str] = []
        with self.lock:
            for name, series in sorted(self.counters.items()):
                lines.append(f"# TYPE {name} counter")
                lines += [f"{name}{fmt_labels(k)} {v}" for k, v in sorted(series.items())]
        for name, value in sorted(counters.items()):
            lines += [f"# TYPE {name} counter", f"{name} {value}"]
        with self.lock:
            for name, series in sorted(self.histograms.items()):
                lines.append(f"# TYPE {name} histogram")
                for k, hist in sorted(series.items()):
                    lines += hist.lines(name, k)
        for name, value in sorted(gauges.items()):
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        return "\n".join(lines) + "\n"


# The status numbers that only grow (a prefix-cache flush resets its own, which Prometheus reads
# as a counter reset); /metrics exposes them as `<name>_total` counters, every other as a gauge.
COUNTER_SERIES = frozenset(
    [
        *(
            f"gr_scheduler_{k}"
            for k in (
                "finished",
                "evicted_results",
                "steps",
                "prefill_batches",
                "prefill_tokens",
                "decode_steps",
                "decode_rows",
            )
        ),
        *(
            f"gr_prefill_cache_{k}"  # the prefix cache, under the name its /status section has
            for k in ("hits", "misses", "hit_tokens", "inserts", "evictions")
        ),
        *(
            f"gr_requests_{k}"
            for k in (
                "submitted",
                "finished",
                "succeeded",
                "aborted",
                "prompt_tokens",
                "cached_tokens",
                "generated_tokens",
                "latency_s_sum",
            )
        ),
        "gr_engine_errors",
        "gr_engine_cuda_graph_replays",
        "gr_weights_weight_update_count",
    ]
)


def split_series(values: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(counters named `<name>_total`, gauges) out of a flat status."""
    counters = {f"{k}_total": v for k, v in values.items() if k in COUNTER_SERIES}
    gauges = {k: v for k, v in values.items() if k not in COUNTER_SERIES}
    return counters, gauges


def numeric_gauges(prefix: str, tree: dict) -> dict[str, float]:
    """Every int, float or bool leaf of a nested status dict, as gr_<path> gauges."""
    out: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}_{key}".replace(".", "_").replace("-", "_")
        if isinstance(value, dict):
            out.update(numeric_gauges(name, value))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            out[name] = value
    return out


class MetricsMiddleware(ASGIMiddleware):
    """Counts and times every routed HTTP request; with log_requests, one JSON line each."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, metrics: Metrics, log_requests: bool = False) -> None:
        self.metrics = metrics
        self.log_requests = log_requests

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        start = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await next_app(scope, receive, recording_send)
        except GrctlError as exc:  # raised by middleware inside this one (the body limit)
            status = exc.status
            raise
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("path_template") or scope["path"]
            method = scope["method"]
            self.metrics.inc(
                "gr_http_requests_total", route=route, method=method, status=str(status)
            )
            self.metrics.observe("gr_http_request_duration_seconds", elapsed, route=route)
            if self.log_requests:
                line = {
                    "method": method,
                    "path": scope["path"],
                    "route": route,
                    "status": status,
                    "ms": round(elapsed * 1000, 3),
                    "client": (scope.get("client") or [""])[0],
                }
                print(json.dumps(line), file=sys.stderr, flush=True)
