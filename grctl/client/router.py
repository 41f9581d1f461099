"""sglang-router's worker registry: list, add and remove the replicas behind it.

SGLang's Rust gateway (`pip install grctl[router]`, `python -m sglang_router.launch_router`)
keeps the list of workers it balances /generate over:
    GET    /workers              {"workers": [{"id", "url", "is_healthy", ...}], "total", ...}
    POST   /workers              {"url", "api_key"?} -> 202 {"worker_id", ...}; it then probes
                                 the worker (/health, /get_server_info, /get_model_info)
    DELETE /workers/{worker_id}  -> 202
Older routers (before 0.2) had GET /list_workers {"urls"}, POST /add_worker?url= and POST
/remove_worker?url=; each call here falls back to those when the new route answers 404.
"""

from __future__ import annotations

from typing import Any

import httpx

from grctl.client.http import ClientTimeout, ConnectionFailed
from grctl.errors import GrctlError

TIMEOUT_S = 10.0


class RouterError(GrctlError):
    """The router refused a registry call, or answered something that is not its worker list."""

    code, status = "router_error", 502


def _call(method: str, router_url: str, path: str, **kw: Any) -> httpx.Response:
    url = router_url.rstrip("/") + path
    try:
        return httpx.request(method, url, timeout=kw.pop("timeout", TIMEOUT_S), **kw)
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
    resp = _call("GET", router_url, "/workers", headers=headers)
    if resp.status_code == 404:
        resp = _check(_call("GET", router_url, "/list_workers", headers=headers), "list workers")
        return [{"url": url} for url in resp.json().get("urls", [])]
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


def add_worker(
    router_url: str, worker_url: str, api_key: str | None = None, headers: dict | None = None
) -> None:
    """Ask the router to take `worker_url` (it probes the worker in the background)."""
    body: dict[str, Any] = {"url": worker_url}
    if api_key:
        body["api_key"] = api_key  # what the router sends to this worker
    resp = _call("POST", router_url, "/workers", json=body, headers=headers)
    if resp.status_code == 404:
        resp = _call("POST", router_url, "/add_worker", params={"url": worker_url}, headers=headers)
    _check(resp, f"add worker {worker_url}")


def remove_worker(router_url: str, worker_url: str, headers: dict | None = None) -> bool:
    """Take `worker_url` out of the router's list; False when it was not listed."""
    resp = _call("GET", router_url, "/workers", headers=headers)
    if resp.status_code == 404:
        resp = _call(
            "POST", router_url, "/remove_worker", params={"url": worker_url}, headers=headers
        )
        return _check(resp, f"remove worker {worker_url}").status_code < 300
    ids = [
        w.get("id")
        for w in _check(resp, "list workers").json().get("workers", [])
        if w.get("url") == worker_url
    ]
    for worker_id in ids:
        _check(
            _call("DELETE", router_url, f"/workers/{worker_id}", headers=headers),
            f"remove worker {worker_url}",
        )
    return bool(ids)
