"""Stop a handler's work when its HTTP client goes away.

uvicorn does not cancel a handler whose client disconnected: it only hands `http.disconnect`
to the next `receive()`. A handler that has read its whole body can therefore watch `receive()`
while it waits and cancel the wait when that message comes; offload()'s `on_cancel` then cancels
the engine requests, so nothing computes for a reply nobody will read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from litestar import Request

from grctl.errors import ClientDisconnected

T = TypeVar("T")


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, fn: Callable[[], Awaitable[T]]) -> T:
    """`await fn()`, cancelled (and ClientDisconnected raised) if the client goes away first.
    Call it only once the request body has been read: the watcher consumes `receive()`."""
    gone, error = False, None
    result: T
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            await until_disconnected(request)
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await fn()
        except Exception as exc:  # raised below as itself, not inside an ExceptionGroup
            error = exc
        finally:
            tg.cancel_scope.cancel()  # the work ended (or failed): stop watching
    if gone:
        raise ClientDisconnected(f"the client of {request.method} {request.url.path} went away")
    if error is not None:
        raise error
    return result
