"""The request-body limit, as ASGI middleware: the one place --max-http-request-bytes is enforced.

A declared Content-Length over the limit is refused before a byte of the body is read; every
body (chunked ones have no Content-Length) is also counted as it is read and refused the moment
it passes the limit.
Both raise PayloadTooLarge, which the exception handlers answer as 413 payload_too_large.
Headers are bounded too (MAX_HEADER_BYTES in all): httptools, unlike h11, sets no limit of its own.
"""

from __future__ import annotations

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from grctl.errors import PayloadTooLarge, ValidationError

MAX_HEADER_BYTES = 64 * 1024  # names and values together; h11's own default limit is 16 KiB


def too_large(limit: int, size: int | None = None) -> PayloadTooLarge:
    what = f"{size} bytes" if size is not None else "the body"
    return PayloadTooLarge(
        f"request body too large: {what} over the limit of {limit} bytes",
        hint="raise --max-http-request-bytes, or send less per request",
    )


def declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise ValidationError(f"malformed Content-Length: {value!r}") from None
    return None


class BodyLimitMiddleware(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            raise PayloadTooLarge(
                f"request headers too large: {header_bytes} bytes over the limit of "
                f"{MAX_HEADER_BYTES} bytes"
            )
        limit = self.max_bytes
        length = declared_length(scope)
        if length is not None and length > limit:
            raise too_large(limit, length)
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit)
            return message

        await next_app(scope, counting_receive, send)
