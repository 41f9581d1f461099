"""The error family shared by the engine, the server, the client and the CLI.

Each class carries the wire code, HTTP status and retryable flag of docs/http-api.md, so the server
maps any GrctlError to the error shape in one place and the client raises the same class back.
"""

from __future__ import annotations


class GrctlError(Exception):
    code = "internal_error"
    status = 500
    retryable = False

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"

    def to_dict(self) -> dict:
        return {
            "code": self.code,
            "message": str(self),
            "retryable": self.retryable,
            "status": self.status,
        }


class ValidationError(GrctlError):
    code, status = "validation_error", 400


class WeightValidationError(ValidationError):
    """A checkpoint or tensor chunk that does not fit the served model; nothing was copied."""


class Unauthorized(GrctlError):
    code, status = "unauthorized", 401


class Forbidden(GrctlError):
    code, status = "forbidden", 403


class WrongApiKey(Forbidden):
    """The API key sent is not the server's (the wire code stays `forbidden`)."""


class RouteDisabled(GrctlError):
    code, status = "route_disabled", 403


class NotFound(GrctlError):
    code, status = "not_found", 404


class Conflict(GrctlError):
    code, status = "conflict", 409


class DuplicateRequestId(GrctlError):
    code, status = "duplicate_request_id", 409


class PayloadTooLarge(GrctlError):
    code, status = "payload_too_large", 413


class Overloaded(GrctlError):
    code, status, retryable = "overloaded", 429, True


class CacheBusy(GrctlError):
    """/flush_cache while requests hold KV: SGLang answers 400 there, and slime retries."""

    code, status, retryable = "cache_busy", 400, True


class InternalError(GrctlError):
    code, status = "internal_error", 500


class Paused(GrctlError):
    code, status, retryable = "paused", 503, True


class WeightsInconsistent(GrctlError):
    """A weight copy failed after it began: the tensors it may have touched are torn, and
    nothing is served until each of them is written again."""

    code, status, retryable = "weights_inconsistent", 503, True


class WeightsDiscarded(GrctlError):
    """A memory release dropped the weights' bytes (no host backup, SGLang's default): nothing
    is served until the trainer writes them again after resume."""

    code, status, retryable = "weights_discarded", 503, True


class WeightsInconsistentConflict(WeightsInconsistent):
    """/continue_generation or /end_weight_update while tensors are torn: 409."""

    status, retryable = 409, False


class MemoryReleased(GrctlError):
    """/release_memory_occupation freed weights, KV or graphs: nothing runs until they are back."""

    code, status, retryable = "memory_released", 503, True


class WeightsMixed(GrctlError):
    """The served tensors carry more than one version label (a sync stopped part-way): nothing
    is served from them until the rest of the update arrives or an operator relabels them."""

    code, status, retryable = "weights_mixed", 503, True


class WeightsMixedConflict(WeightsMixed):
    """/continue_generation or /end_weight_update while the weights are mixed: 409."""

    status, retryable = 409, False


class NotReady(GrctlError):
    code, status, retryable = "not_ready", 503, True


class PauseTimeout(GrctlError):
    """The step running when a pause came did not end in time: paused, but not yet quiet."""

    code, status, retryable = "pause_timeout", 503, True


class Unavailable(GrctlError):
    """A 503 with no more specific cause (not one grctl itself raises)."""

    code, status, retryable = "unavailable", 503, True


class ClientDisconnected(GrctlError):
    """The client closed the connection before its reply; its requests were cancelled."""

    code, status = "client_disconnected", 499  # nginx's "client closed request"


class GenerateTimeout(GrctlError):
    code, status, retryable = "generate_timeout", 504, True


class NotSupported(GrctlError):
    """A route SGLang serves for a transport or feature grctl does not have (RDMA, LoRA, ...):
    the message names what to use instead."""

    code, status = "not_supported", 501


class RouterError(GrctlError):
    """An sglang-router refused a registry call, could not be reached, or answered something
    that is not its worker list (raised by a replica joining it and by a fleet push reading it;
    no grctl server answers with this code)."""

    code, status = "router_error", 502


ERRORS_BY_CODE: dict[str, type[GrctlError]] = {
    cls.code: cls
    for cls in (
        ValidationError,
        Unauthorized,
        Forbidden,
        RouteDisabled,
        NotFound,
        Conflict,
        DuplicateRequestId,
        PayloadTooLarge,
        Overloaded,
        CacheBusy,
        InternalError,
        Paused,
        WeightsInconsistent,
        WeightsDiscarded,
        MemoryReleased,
        WeightsMixed,
        NotReady,
        PauseTimeout,
        Unavailable,
        ClientDisconnected,
        GenerateTimeout,
        NotSupported,
    )
}


def error_from_wire(body: dict, status: int) -> GrctlError:
    """Rebuild the GrctlError a server answered with (used by the client library)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        message = body.get("message") if isinstance(body, dict) else None
        exc = GrctlError(str(message or body))
        exc.status = status
        return exc
    cls = ERRORS_BY_CODE.get(str(err.get("code")), GrctlError)
    exc = cls(str(err.get("message", "")))
    exc.status = int(err.get("status", status))
    exc.retryable = bool(err.get("retryable", cls.retryable))
    if cls is GrctlError:
        exc.code = str(err.get("code", "internal_error"))
    return exc
