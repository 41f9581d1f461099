"""How a route is called: a `Call` (method, path, body, how to read the reply), the errors of a
call that got no reply, the decoders that turn a reply into a result, and the body builder for
/generate, /submit and /submit_many."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import msgspec

from grctl.errors import GrctlError
from grctl.protocol.info import ServerStatus
from grctl.protocol.weights import StatusWeights


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    decode: Callable[[Any], Any]  # the parsed JSON body (or text) -> the result
    json: dict | None = None
    params: dict | None = None
    kind: str = "control"  # control | generate | update: picks the client's timeout
    ok_statuses: tuple[int, ...] = ()  # error statuses that still carry a normal reply
    extra_timeout: float = 0.0  # added to the timeout (a server-side wait the call asks for)


class ConnectionFailed(GrctlError):
    """The server could not be reached (refused, reset, DNS): no reply at all."""

    code, status, retryable = "connection_error", 0, True


class ClientTimeout(GrctlError):
    """The server did not answer within the client's timeout."""

    code, status, retryable = "client_timeout", 0, True


# Answered before a route handler reads the body: auth, the body limit, routing.
UNREAD_STATUSES = (401, 403, 404, 405, 413)


def body_never_read(exc: BaseException) -> bool:
    """Whether a failed call's body never reached a route handler: refused up front, or the
    connection failed or was reset. A timeout is not: the server may still read it later."""
    cause = exc.__cause__
    if isinstance(cause, httpx.TimeoutException):
        return False
    if isinstance(cause, httpx.TransportError):
        return True
    return isinstance(exc, GrctlError) and exc.status in UNREAD_STATUSES


def as_(cls: Any) -> Callable[[Any], Any]:
    """Read a reply as `cls` (a protocol Struct, or a list of them), leniently."""
    return partial(msgspec.convert, type=cls, strict=False)


def status_of(body: dict) -> ServerStatus:
    weights = msgspec.convert(body.get("weights") or {}, StatusWeights, strict=False)
    return ServerStatus(weights=weights, sections={k: v for k, v in body.items() if k != "weights"})


def text(body: Any) -> str:
    return body


def compact(**kw: Any) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


def request_body(
    input_ids: Sequence[int] | None = None,
    sampling_params: dict | None = None,
    *,
    text: str | None = None,
    return_logprob: bool = False,
    rid: str | None = None,
    use_catalog: bool | None = None,
    logits_processors: Sequence[dict] | None = None,
    **sampling: Any,
) -> dict:
    """A /generate or /submit body; keyword sampling options (max_new_tokens=3, n=4) merge into
    `sampling_params`. use_catalog=False opts out of the server's item catalog;
    logits_processors: [{"type": "token_suppress", "token_ids": [...]}, ...]. Use it to build
    the list for submit_many."""
    body = compact(input_ids=list(input_ids) if input_ids is not None else None, text=text, rid=rid)
    body["sampling_params"] = {**(sampling_params or {}), **sampling}
    if use_catalog is not None:
        body["sampling_params"]["use_catalog"] = use_catalog
    if logits_processors is not None:
        body["logits_processors"] = list(logits_processors)
    if return_logprob:
        body["return_logprob"] = True
    return body
