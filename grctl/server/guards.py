"""What the routes check before they run, shared by their modules: the switches that turn route
groups on (--allow-weight-update, --allow-catalog-reload), the weights being held, and SGLang's
runner selector."""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler

from grctl.errors import RouteDisabled, ValidationError
from grctl.protocol.weights import SELECTORS


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


def checked_catalog_path(state: State, path: str | None) -> str | None:
    """A weight update's catalog_path: needs --allow-catalog-reload as /catalog/reload does,
    and the same path rules (a non-empty string, under --weights-root when set)."""
    if path is None:
        return None
    if not state.config.allow_catalog_reload:
        raise RouteDisabled(
            "catalog_path needs catalog reloads to be allowed",
            hint="start the server with --allow-catalog-reload (or GR_ALLOW_CATALOG_RELOAD=1), "
            "or send the update without catalog_path",
        )
    return state.engine.catalogs.checked_path(path)


def require_weights(state: State) -> None:
    """Reading or writing the weights while /release_memory_occupation holds them on the host
    is a 503 (the engine refuses a write again under its lock)."""
    state.engine.require_weights("the weights cannot be read or written")


def check_selector(selector: str) -> None:
    """SGLang's `selector` picks the target model, its draft model, or both: grctl has one."""
    if selector not in SELECTORS:
        raise ValidationError(
            f"selector {selector!r} is not served: grctl has one model and no draft model",
            hint="send 'all' or 'target'",
        )
