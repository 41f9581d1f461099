"""A fleet push's view of an sglang-router: the workers it lists (routes: protocol/router.py)."""

from __future__ import annotations

from typing import Any

import httpx

from grctl.client.http import ClientTimeout, ConnectionFailed
from grctl.errors import RouterError
from grctl.protocol import router


def _call(method: str, router_url: str, path: str, **kw: Any) -> httpx.Response:
    url = router_url.rstrip("/") + path
    try:
        return httpx.request(method, url, timeout=router.TIMEOUT_S, **kw)
    except httpx.TimeoutException as exc:
        raise ClientTimeout(f"router {router_url} did not answer {method} {path}") from exc
    except httpx.TransportError as exc:
        raise ConnectionFailed(
            f"cannot reach the router at {router_url}: {exc}",
            hint="is sglang_router.launch_router running there?",
        ) from exc


def _check(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.status_code >= 400:
        raise RouterError(f"router refused to {what}: HTTP {resp.status_code} {resp.text[:200]}")
    return resp


def list_workers(router_url: str, headers: dict[str, str] | None = None) -> list[dict]:
    """Every registered worker as the router describes it (each has at least "url")."""
    resp = _call("GET", router_url, router.WORKERS, headers=headers)
    if resp.status_code == 404:
        old = _call("GET", router_url, router.OLD_LIST_WORKERS, headers=headers)
        return [{"url": url} for url in _check(old, "list workers").json().get("urls", [])]
    body = _check(resp, "list workers").json()
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list) or not all(isinstance(w, dict) for w in workers):
        raise RouterError(f"{router_url}/workers is not a worker list: {str(body)[:200]}")
    return workers


def worker_urls(router_url: str, headers: dict[str, str] | None = None) -> list[str]:
    """The URLs of the workers behind the router, in its order: what a fleet push syncs."""
    urls = [w["url"] for w in list_workers(router_url, headers) if w.get("url")]
    if not urls:
        raise RouterError(
            f"the router at {router_url} lists no workers",
            hint="start replicas with `grctl serve --router-url ...`, or add them to the router",
        )
    return urls
