"""When and how the client calls a route again: tenacity's policies over the `retryable` flag
every GrctlError carries (docs/http-api.md "Errors").

Two policies. `flush_policy` is slime's /flush_cache loop: a fixed interval, a fixed number of
tries, until the server answers 200. `call_policy` (GRClient(..., retries=N)) retries any call
the server refused before doing anything (503 paused / not_ready / weights_mixed, 429
overloaded, a connection that never reached it) with jittered exponential backoff; a call that
timed out is retried only if it is a GET, since the server may still be running a POST.
"""

from __future__ import annotations

from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_fixed,
    wait_random_exponential,
)

from grctl.client.calls import Call, ClientTimeout
from grctl.errors import CacheBusy, GrctlError


def is_flush_retryable(exc: BaseException) -> bool:
    # slime retries any non-200; a refused connection means no server, so that one is final.
    return isinstance(exc, GrctlError) and (
        isinstance(exc, (CacheBusy, ClientTimeout)) or exc.status in (400, 503)
    )


def flush_gave_up(retries: int, last: BaseException | None) -> CacheBusy:
    # No hint of our own: the server's last reply says what would let the flush through (pause
    # first, or resume an in_place pause); callers name the server, so the message does not.
    return CacheBusy(f"/flush_cache did not succeed after {retries} tries; last reply: {last}")


def flush_policy(retries: int, interval: float, *, is_async: bool = False):
    kind = AsyncRetrying if is_async else Retrying
    return kind(
        stop=stop_after_attempt(max(1, retries)),
        wait=wait_fixed(interval),
        retry=retry_if_exception(is_flush_retryable),
        retry_error_callback=lambda state: _raise(
            flush_gave_up(retries, state.outcome.exception())
        ),
    )


def is_call_retryable(call: Call, exc: BaseException) -> bool:
    if not isinstance(exc, GrctlError) or not exc.retryable:
        return False
    return call.method == "GET" or not isinstance(exc, ClientTimeout)


def call_policy(call: Call, retries: int, max_wait: float, *, is_async: bool = False):
    """`retries` more tries after the first, jittered exponential waits capped at max_wait s;
    the last error is raised as it came."""
    kind = AsyncRetrying if is_async else Retrying
    return kind(
        stop=stop_after_attempt(retries + 1),
        wait=wait_random_exponential(multiplier=0.1, max=max_wait),
        retry=retry_if_exception(lambda exc: is_call_retryable(call, exc)),
        reraise=True,
    )


def _raise(exc: BaseException):
    raise exc
