"""offload(): the one way a handler runs a blocking engine or weights call in a worker thread.

A handler cancelled while its call runs (a shutdown, a disconnect watcher) must not leave the
call running on its own: `on_cancel` is run to stop it (for /generate: cancel its engine
requests), and the handler then waits, shielded, for the thread to end before it re-raises. A
call whose thread had not started when the handler was cancelled never runs at all.

offload_json() is the one way a handler answers a reply that can be large (a prompt's top
logprobs, a sampling mask, a completions echo with logprobs): the reply is built and encoded to
JSON bytes in the worker thread, so Litestar sends bytes and encodes nothing on the event loop
(a 31 MB reply took 120 ms of the loop to encode).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
from anyio import CancelScope, get_cancelled_exc_class, to_thread
from litestar import Response
from litestar.datastructures import State
from litestar.enums import MediaType

T = TypeVar("T")


class _Call:
    """The call, plus what the cancel path needs to know: did it start, has it ended."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.lock = threading.Lock()
        self.started = False
        self.cancelled = False
        self.ended = threading.Event()

    def __call__(self) -> Any:
        with self.lock:
            if self.cancelled:
                return None
            self.started = True
        try:
            return self.fn()
        finally:
            self.ended.set()

    def cancel(self) -> bool:
        """Stop it from starting; True when it had already started (so there is an end to await)."""
        with self.lock:
            self.cancelled = True
            return self.started


async def offload(
    state: State,
    fn: Callable[..., T],
    *args: Any,
    on_cancel: Callable[[], object] | None = None,
    **kwargs: Any,
) -> T:
    """Run fn(*args, **kwargs) in a thread of app.state.waiters and return its result."""
    call = _Call(partial(fn, *args, **kwargs))
    try:
        return await to_thread.run_sync(call, limiter=state.waiters, abandon_on_cancel=True)
    except get_cancelled_exc_class():
        if call.cancel():
            if on_cancel is not None:
                on_cancel()
            with CancelScope(shield=True):  # its own thread: the waiters may all be taken
                await to_thread.run_sync(call.ended.wait)
        raise


def _encoded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bytes:
    return msgspec.json.encode(fn(*args, **kwargs))


async def offload_json(
    state: State, fn: Callable[..., Any], *args: Any, status_code: int = 200, **kwargs: Any
) -> Response:
    """fn(*args, **kwargs), a msgspec Struct (or list, dict), built and encoded to JSON in a
    thread of app.state.waiters: a Response of those bytes."""
    body = await offload(state, _encoded, fn, *args, **kwargs)
    return Response(body, status_code=status_code, media_type=MediaType.JSON)
