"""/metrics: prometheus_client's registry, one per app. The HTTP and generate series are kept
here as requests pass; the engine's and SGLang's families are read at scrape time
(engine_metrics.py). HTTP series are labelled by route template (/poll/{request_id}, never the
id), and a request no route matched by `route="unmatched"`, so their number stays bounded.
"""

from __future__ import annotations

import logging
import time

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.registry import Collector

from grctl.engine.request import GenerateResult
from grctl.errors import GrctlError
from grctl.server.logs import event

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
UNMATCHED = "unmatched"  # the route label of a request no route matched (404, a scanner)
access_log = logging.getLogger("grctl.access")
disable_created_metrics()  # no `_created` series beside every counter (SGLang exports none)


class Metrics:
    """The app's registry and the series it keeps itself."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        kw = {"registry": self.registry}
        self.http_requests = Counter(
            "gr_http_requests",
            "HTTP requests answered, by route template (unmatched: no route), method and status.",
            ["route", "method", "status"],
            **kw,
        )
        self.http_duration = Histogram(
            "gr_http_request_duration_seconds",
            "Time from a request's arrival to its reply, by route template.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            **kw,
        )
        self.results = Counter(
            "gr_generate_results",
            "Generation replies, by finish reason (a multi-stage request once, at its last stage).",
            ["finish_reason"],
            **kw,
        )
        self.latency = Histogram(
            "gr_generate_latency_seconds",
            "A generation request's time in the engine, queued to finished.",
            buckets=LATENCY_BUCKETS,
            **kw,
        )
        self.e2e = Histogram(  # SGLang's name and labels (its tokenizer manager's)
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            ["model_name", "is_streaming"],
            buckets=LATENCY_BUCKETS,
            **kw,
        )
        self.invalid_http = Counter(
            "gr_http_invalid_requests",
            "Connections whose bytes were not HTTP (a router's TCP probe, a scanner): uvicorn's "
            "'Invalid HTTP request received', logged at debug only.",
            **kw,
        )

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def observe_result(self, result: GenerateResult) -> None:
        """A result handed out over HTTP (/generate, /result): its end and engine latency."""
        self.observe(result.finish_reason, result.latency_s)

    def observe(self, finish_reason: str, latency_s: float) -> None:
        """One reply's end and latency: a one-stage result's, or a multi-stage request's
        (counted once, when its last stage ends, its latency over all of its stages)."""
        self.results.labels(finish_reason=finish_reason).inc()
        self.latency.observe(latency_s)
        self.e2e.labels(model_name=self.model_name, is_streaming="false").observe(latency_s)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class InvalidHttpFilter(logging.Filter):
    """uvicorn logs bytes that are not HTTP (sglang-router's and smg's TCP probes, scanners) as
    'WARNING Invalid HTTP request received.': counted in /metrics instead, and logged at debug
    only when grctl logs at debug."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self.metrics = metrics

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Invalid HTTP request"):
            return True
        self.metrics.invalid_http.inc()
        return logging.getLogger("grctl").isEnabledFor(logging.DEBUG)


def install_log_filter(metrics: Metrics) -> None:
    uvicorn_error = logging.getLogger("uvicorn.error")
    for old in [f for f in uvicorn_error.filters if isinstance(f, InvalidHttpFilter)]:
        uvicorn_error.removeFilter(old)  # the latest app's registry counts them
    uvicorn_error.addFilter(InvalidHttpFilter(metrics))


class MetricsMiddleware(ASGIMiddleware):
    """Counts and times every HTTP request; with log_requests, one `request` log event each
    (through the server's log formatter: text or JSON with ts, level and logger)."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, metrics: Metrics, log_requests: bool = False) -> None:
        self.metrics = metrics
        self.log_requests = log_requests
        if log_requests:  # asked for: shown whatever --log-level says of other events
            access_log.setLevel(logging.INFO)

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
            route = scope.get("path_template") or UNMATCHED
            method = scope["method"]
            self.metrics.http_requests.labels(route=route, method=method, status=str(status)).inc()
            self.metrics.http_duration.labels(route=route).observe(elapsed)
            if self.log_requests:
                event(
                    "request",
                    logger=access_log,
                    method=method,
                    path=scope["path"],
                    route=route,
                    status=status,
                    ms=round(elapsed * 1000, 3),
                    client=(scope.get("client") or [""])[0],
                )
