"""GRClient and AsyncGRClient: the routes of docs/http-api.md over httpx.

    with GRClient("http://127.0.0.1:8000", api_key="k") as gr:
        gr.pause_generation()
        gr.flush_cache_until_ok()
        gr.update_weights_from_disk("/ckpt/step_7", weight_version=7)
        gr.continue_generation()

Every call has a timeout (control calls 30 s, generate 330 s, weight updates 600 s by default);
nothing waits forever. A server error comes back as the GrctlError subclass of its code
(`grctl.errors`); a server that cannot be reached is ConnectionFailed, one that does not answer
in time ClientTimeout.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from grctl.client.calls import Call, ClientTimeout, ConnectionFailed, text
from grctl.client.retry import call_policy, flush_policy
from grctl.client.routes import Routes
from grctl.errors import GrctlError, ValidationError, error_from_wire
from grctl.protocol.info import API_KEY_HEADER, FlushCacheResponse

DEFAULT_URL = "http://127.0.0.1:8000"


def auth_headers(api_key: str | None, bearer: bool) -> dict[str, str]:
    if not api_key:
        return {}
    return {"Authorization": f"Bearer {api_key}"} if bearer else {API_KEY_HEADER: api_key}


def read_reply(url: str, resp: httpx.Response, call: Call) -> Any:
    """The reply's result, or the server's error raised as its GrctlError subclass."""
    status = resp.status_code
    is_error = status >= 400 and status not in call.ok_statuses
    if status < 400 and call.decode is text:
        return resp.text
    try:
        body = resp.json()
    except ValueError:
        body = {"message": resp.text.strip() or f"HTTP {status} {resp.reason_phrase}"}
        is_error = True
    if is_error or (isinstance(body, dict) and body.get("success") is False):
        raise error_from_wire(body, status)
    try:
        return call.decode(body)
    except msgspec.ValidationError as exc:
        raise GrctlError(f"unexpected reply from {url}{call.path}: {exc}") from exc


def normalize_url(url: str) -> str:
    """`host:port` -> `http://host:port` (what curl and SGLang's clients accept too); any
    scheme but http(s) is refused."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValidationError(f"server URL {url!r} must start with http:// or https://")
    return url


class _Base(Routes):
    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        bearer: bool = False,
        timeout: float = 30.0,
        generate_timeout: float = 330.0,
        update_timeout: float = 600.0,
        retries: int = 0,
        retry_max_wait: float = 5.0,
    ):
        self.url = normalize_url(url)
        # calls the server refused before doing anything (retryable errors) are tried again
        # `retries` times with jittered exponential backoff (grctl/client/retry.py)
        self.retries, self.retry_max_wait = max(0, int(retries)), retry_max_wait
        self.timeouts = {"control": timeout, "generate": generate_timeout, "update": update_timeout}
        self._kw = dict(
            base_url=self.url,
            headers=auth_headers(api_key, bearer),
            timeout=timeout,
            trust_env=False,  # talk to the fleet directly, never through an HTTP proxy
        )

    def _timeout(self, call: Call) -> float:
        return self.timeouts[call.kind] + call.extra_timeout

    def _transport_error(self, call: Call, exc: httpx.HTTPError) -> GrctlError:
        where = f"{call.method} {self.url}{call.path}"
        if isinstance(exc, httpx.TimeoutException):
            return ClientTimeout(f"{where}: no reply within {self._timeout(call):g} s")
        return ConnectionFailed(
            f"{where}: cannot reach the server ({type(exc).__name__}: {exc})",
            hint="is `grctl serve` running at that address?",
        )


class GRClient(_Base):
    """Blocking client: one method per route, each returning its typed result."""

    def __init__(self, url: str = DEFAULT_URL, **kw: Any):
        super().__init__(url, **kw)
        self._http = httpx.Client(**self._kw)

    def _call(self, call: Call) -> Any:
        if not self.retries:
            return self._send(call)
        return call_policy(call, self.retries, self.retry_max_wait)(self._send, call)

    def _send(self, call: Call) -> Any:
        try:
            resp = self._http.request(
                call.method,
                call.path,
                json=call.json,
                params=call.params,
                timeout=self._timeout(call),
            )
        except httpx.HTTPError as exc:
            raise self._transport_error(call, exc) from exc
        return read_reply(self.url, resp, call)

    def flush_cache_until_ok(self, retries: int = 60, interval: float = 1.0) -> FlushCacheResponse:
        """slime's loop: GET /flush_cache until it answers 200, `retries` tries `interval` s
        apart. Raises CacheBusy naming the last reply when every try failed."""
        return flush_policy(retries, interval)(self.flush_cache)

    def push_tensors(
        self,
        named_tensors,
        *,
        bucket_mb: float = 512,
        weight_version: str | int | None = None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
    ):
        """Push tensors this process holds (a state dict or (hf_name, tensor) pairs, CPU or
        CUDA) as flattened buckets of `bucket_mb` MiB, labelled `weight_version`: no checkpoint
        written, no pause or resume (pause first, or use WeightSync.run for the whole sequence).
        Planned against the served structure before the first bucket; returns the SyncResult,
        raises SyncError naming how many buckets the server took."""
        from grctl.client.push import push_tensors  # torch: only when a push is asked for

        return push_tensors(
            self,
            named_tensors,
            bucket_mb=bucket_mb,
            weight_version=weight_version,
            token_step=token_step,
            flush_cache=flush_cache,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GRClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGRClient(_Base):
    """asyncio client: the same methods as GRClient, each returning an awaitable."""

    def __init__(self, url: str = DEFAULT_URL, **kw: Any):
        super().__init__(url, **kw)
        self._http = httpx.AsyncClient(**self._kw)

    async def _call(self, call: Call) -> Any:
        if not self.retries:
            return await self._send(call)
        policy = call_policy(call, self.retries, self.retry_max_wait, is_async=True)
        return await policy(self._send, call)

    async def _send(self, call: Call) -> Any:
        try:
            resp = await self._http.request(
                call.method,
                call.path,
                json=call.json,
                params=call.params,
                timeout=self._timeout(call),
            )
        except httpx.HTTPError as exc:
            raise self._transport_error(call, exc) from exc
        return read_reply(self.url, resp, call)

    async def flush_cache_until_ok(
        self, retries: int = 60, interval: float = 1.0
    ) -> FlushCacheResponse:
        async def once() -> FlushCacheResponse:  # flush_cache is a plain def returning a coroutine
            return await self.flush_cache()

        return await flush_policy(retries, interval, is_async=True)(once)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncGRClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
