"""The API-key guard: `X-GR-API-Key: <key>` or `Authorization: Bearer <key>`.

Off without --api-key. Handlers with `opt={"auth_exempt": True}` (/health, /ready) skip it, and
so does /metrics (`opt={"metrics": True}`) unless --metrics-auth: scrapers of SGLang and vLLM
expect it open.
A missing key is 401 unauthorized (with WWW-Authenticate), a wrong one 403 forbidden; the error
handler logs both as auth_failure (server/logs.py), never with the key.
"""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from grctl.errors import Unauthorized, WrongApiKey
from grctl.protocol.info import API_KEY_HEADER


def presented_key(connection: ASGIConnection) -> str | None:
    # An Authorization header wins; without the "Bearer " prefix its whole value is the key.
    auth = connection.headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else auth.strip()
    return connection.headers.get(API_KEY_HEADER)


def api_key_guard(connection: ASGIConnection, route_handler: BaseRouteHandler) -> None:
    config = connection.app.state.config
    expected: str | None = config.api_key
    if expected is None or route_handler.opt.get("auth_exempt"):
        return
    if route_handler.opt.get("metrics") and not config.metrics_auth:
        return
    key = presented_key(connection)
    if not key:
        raise Unauthorized(
            "this server needs an API key",
            hint=f"send {API_KEY_HEADER}: <key> or Authorization: Bearer <key>",
        )
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise WrongApiKey(
            "wrong API key", hint="send the key the server was started with (--api-key, GR_API_KEY)"
        )
