"""`grctl serve --router-url`: the replica checks the router (sglang-router or smg) answers before
it starts, joins it once it listens, checks every --router-check-interval seconds that the router
still lists it (joining again after a router restart, which forgets its workers) and leaves it
before it drains (the registry's routes: protocol/router.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from anyio import to_thread
from litestar import Litestar

from grctl.config import ServeConfig
from grctl.errors import RouterError
from grctl.protocol import router

log = logging.getLogger("grctl.server")


def _call(method: str, router_url: str, path: str, **kw: Any) -> httpx.Response:
    url = router_url.rstrip("/") + path
    try:
        return httpx.request(method, url, timeout=router.TIMEOUT_S, **kw)
    except httpx.TimeoutException as exc:
        raise RouterError(f"router {router_url} did not answer {method} {path}") from exc
    except httpx.TransportError as exc:
        raise RouterError(
            f"cannot reach the router at {router_url}: {exc}",
            hint="is sglang_router.launch_router running there?",
        ) from exc


def _check(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.status_code >= 400:
        raise RouterError(f"router refused to {what}: HTTP {resp.status_code} {resp.text[:200]}")
    return resp


def add_worker(router_url: str, worker_url: str, api_key: str | None = None) -> None:
    """Ask the router to take `worker_url` (it probes the worker in the background)."""
    body: dict[str, Any] = {"url": worker_url}
    if api_key:
        body["api_key"] = api_key  # what the router sends to this worker
    resp = _call("POST", router_url, router.WORKERS, json=body)
    if resp.status_code == 404:
        resp = _call("POST", router_url, router.OLD_ADD_WORKER, params={"url": worker_url})
    _check(resp, f"add worker {worker_url}")


def remove_worker(router_url: str, worker_url: str) -> bool:
    """Take `worker_url` out of the router's list; False when it was not listed."""
    resp = _call("GET", router_url, router.WORKERS)
    if resp.status_code == 404:
        resp = _call("POST", router_url, router.OLD_REMOVE_WORKER, params={"url": worker_url})
        return _check(resp, f"remove worker {worker_url}").status_code < 300
    ids = [
        w.get("id")
        for w in _check(resp, "list workers").json().get("workers", [])
        if w.get("url") == worker_url
    ]
    for worker_id in ids:
        _check(
            _call("DELETE", router_url, f"{router.WORKERS}/{worker_id}"),
            f"remove worker {worker_url}",
        )
    return bool(ids)


def is_listed(router_url: str, worker_url: str) -> bool:
    """Whether the router's worker list holds `worker_url`."""
    resp = _call("GET", router_url, router.WORKERS)
    if resp.status_code == 404:
        resp = _call("GET", router_url, router.OLD_LIST_WORKERS)
        return worker_url in _check(resp, "list workers").json().get("urls", [])
    workers = _check(resp, "list workers").json().get("workers", [])
    return any(w.get("url") == worker_url for w in workers)


def keep_joined(config: ServeConfig, url: str, stop: threading.Event, joined: threading.Event):
    """Join the router, then check every --router-check-interval seconds that it still lists
    this server and join again when it does not (a restarted router has an empty list); an
    unreachable router is logged once per outage and tried again at the next check."""
    router_url, failing = config.router_url, False
    while not stop.is_set():
        try:
            if not joined.is_set():
                add_worker(router_url, url, config.api_key)
                joined.set()
                log.info("joined the router at %s as %s", router_url, url)
            elif not is_listed(router_url, url):
                add_worker(router_url, url, config.api_key)
                log.warning(
                    "the router at %s no longer listed this server (restarted?): joined it "
                    "again as %s",
                    router_url,
                    url,
                )
            elif failing:
                log.info("the router at %s answers again and lists this server", router_url)
            failing = False
        except Exception as exc:
            if not stop.is_set() and not failing:
                what = "check" if joined.is_set() else "join"
                log.error(
                    "could not %s the router at %s: %s (trying again every %g s)",
                    what,
                    router_url,
                    exc,
                    config.router_check_interval,
                )
            failing = True
        stop.wait(config.router_check_interval)


def advertised_url(config: ServeConfig) -> str:
    """The URL a router reaches this server at: a wildcard host is replaced by this host's name."""
    if config.host in ("0.0.0.0", "::", ""):
        return f"http://{socket.getfqdn()}:{config.port}"
    return config.url


def check_reachable(router_url: str) -> None:
    """The router answers its worker list (else the replica does not start)."""
    resp = _call("GET", router_url, router.WORKERS)
    if resp.status_code == 404:
        resp = _call("GET", router_url, router.OLD_LIST_WORKERS)
    _check(resp, "list workers")


def wait_listening(config: ServeConfig, stop: threading.Event, timeout: float = 120.0) -> bool:
    """Until this server answers /health on its own port (uvicorn binds after the lifespan's
    startup): a router probes a worker as soon as it is added, and smg retries a failed first
    probe only 30 s later."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(config.host, config.host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    deadline = time.monotonic() + timeout
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{host}:{config.port}/health", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stop.wait(0.05)
    return False


@asynccontextmanager
async def router_membership(app: Litestar) -> AsyncIterator[None]:
    """With --router-url: check the router answers before the server starts, join it once the
    server listens and keep it joined (keep_joined), leave before it drains."""
    config = app.state.config
    if not config.router_url:
        yield
        return
    url = advertised_url(config)
    await to_thread.run_sync(check_reachable, config.router_url)
    stop, joined = threading.Event(), threading.Event()

    async def join() -> None:
        if await to_thread.run_sync(wait_listening, config, stop):
            await to_thread.run_sync(keep_joined, config, url, stop, joined)
        elif not stop.is_set():
            log.error(
                "could not join the router at %s: this server never answered its own /health",
                config.router_url,
            )

    task = asyncio.ensure_future(join())
    try:
        yield
    finally:
        stop.set()
        await task
        if joined.is_set():
            try:
                await to_thread.run_sync(remove_worker, config.router_url, url)
                log.info("left the router at %s", config.router_url)
            except Exception as exc:  # the router may be gone first; shutting down goes on
                log.warning("could not leave the router at %s: %s", config.router_url, exc)
