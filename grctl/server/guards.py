"""What the routes check before they run, shared by their modules: the switches that turn route
groups on (--allow-weight-update, --allow-catalog-reload) and the weights being held."""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler

from grctl.errors import RouteDisabled


def weight_update_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    if not connection.app.state.config.allow_weight_update:
        raise RouteDisabled(
            f"{connection.url.path} is disabled",
            hint="start the server with --allow-weight-update (or GR_ALLOW_WEIGHT_UPDATE=1)",
        )


def catalog_reload_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    if not connection.app.state.config.allow_catalog_reload:
        raise RouteDisabled(
            f"{connection.url.path} is disabled",
            hint="start the server with --allow-catalog-reload (or GR_ALLOW_CATALOG_RELOAD=1)",
        )


def require_weights(state: State) -> None:
    """Reading or writing the weights while /release_memory_occupation holds them on the host
    is a 503 (the engine refuses a write again under its lock)."""
    state.engine.require_weights("the weights cannot be read or written")
