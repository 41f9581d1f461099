"""One place that turns every exception into docs/http-api.md's error shape.

`{"error": {"code", "message", "retryable", "status"}}`. A route handler whose `opt` holds
`sglang_errors=True` (the weight-update routes) also gets `"success": false` and `"message"` at
the top level, which is what SGLang-style clients read.
"""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from grctl.errors import GrctlError, Unauthorized, WrongApiKey
from grctl.server import logs
from grctl.server.metrics import UNMATCHED

log = logging.getLogger("grctl.server")

RETRY_AFTER_S = "1"  # seconds, on retryable 429 and 503 replies (clients back off from there)
SGLANG_ERRORS = {"sglang_errors": True}  # the opt of the routes whose errors SGLang's clients read

CODES_BY_STATUS = {
    400: "validation_error",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    429: "overloaded",
    500: "internal_error",
    503: "unavailable",  # a cause grctl knows has its own GrctlError (paused, not_ready, ...)
    504: "generate_timeout",
}


def error_response(
    request: Request,
    code: str,
    message: str,
    status: int,
    retryable: bool = False,
    headers: dict[str, str] | None = None,
    event: str = "refused",
) -> Response:
    """The error reply, and its one log line (`event`: refused, or auth_failure)."""
    logs.event(
        event,
        logging.ERROR if status >= 500 and status != 503 else logging.WARNING,
        code=code,
        status=status,
        method=request.method,
        path=request.url.path,
        client=request.client.host if request.client else None,
        message=message[:300],
    )
    error = {"code": code, "message": message, "retryable": retryable, "status": status}
    body: dict = {"error": error}
    if retryable and status in (429, 503):  # overloaded, paused, ...: when to come back
        headers = {"Retry-After": RETRY_AFTER_S, **(headers or {})}
    if "path_template" not in request.scope:  # no route matched: the metrics middleware,
        # which wraps routes only, never saw it
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.http_requests.labels(
                route=UNMATCHED, method=request.method, status=str(status)
            ).inc()
    handler = request.scope.get("route_handler")
    if handler is not None and handler.opt.get("sglang_errors"):
        body = {"success": False, "message": message, **body}
    return Response(body, status_code=status, headers=headers)


def grctl_error_handler(request: Request, exc: GrctlError) -> Response:
    headers = (
        {"WWW-Authenticate": 'Bearer realm="grctl"'} if isinstance(exc, Unauthorized) else None
    )
    event = "auth_failure" if isinstance(exc, (Unauthorized, WrongApiKey)) else "refused"
    return error_response(request, exc.code, str(exc), exc.status, exc.retryable, headers, event)


def validation_message(exc: ValidationException) -> str:
    """Litestar's own message plus each failing key, e.g. 'input_ids: Expected `array`'."""
    details = exc.extra if isinstance(exc.extra, list) else []
    parts = []
    for d in details:
        if isinstance(d, dict):
            key = d.get("key")
            parts.append(f"{key}: {d.get('message')}" if key else str(d.get("message")))
    return f"{exc.detail}: {'; '.join(parts)}" if parts else exc.detail


def http_exception_handler(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors: 404/405 from routing, 400 from body parsing and validation."""
    status = exc.status_code
    if isinstance(exc, ValidationException) or status == 400:
        message = validation_message(exc) if isinstance(exc, ValidationException) else exc.detail
        return error_response(request, "validation_error", message, 400)
    message = exc.detail
    if status == 404:
        message = f"unknown route: {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    code = CODES_BY_STATUS.get(status, "http_error")
    headers = dict(exc.headers or {})
    return error_response(request, code, message, status, status in (429, 503, 504), headers)


def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    message = f"internal error: {type(exc).__name__}: {exc}"
    return error_response(request, "internal_error", message, 500)


def recursion_error_handler(request: Request, exc: RecursionError) -> Response:
    """A body nested deeper than the decoder's stack: the client's input, not our fault."""
    return error_response(request, "validation_error", "the JSON body nests too deeply", 400)


EXCEPTION_HANDLERS = {
    RecursionError: recursion_error_handler,
    GrctlError: grctl_error_handler,
    HTTPException: http_exception_handler,
    Exception: internal_error_handler,
}
