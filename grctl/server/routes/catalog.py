"""Catalog routes: GET /catalog/status, POST /catalog/reload {"path"}, POST /catalog/rollback
{"force"} (a rollback to a catalog of other weights than the served ones is a 409 unless forced).

Reload and rollback are off unless --allow-catalog-reload (403 route_disabled). A reload builds
the new catalog in a worker thread beside the one being served and swaps it in one assignment;
a request keeps the catalog it was submitted with. A file that cannot be served is a 400 naming
its line, and the old catalog keeps serving.
"""

from __future__ import annotations

from typing import Annotated

from litestar import Router, get, post
from litestar.datastructures import State
from litestar.params import Body

from grctl.engine import catalog_swap
from grctl.protocol.catalog import CatalogReloadBody, CatalogRollbackBody, CatalogStatus
from grctl.server.guards import catalog_reload_guard
from grctl.server.offload import offload


def status_of(state: State) -> CatalogStatus:
    return CatalogStatus(**state.engine.catalogs.status())


@get("/catalog/status", summary="The served item catalog: version, counts, bytes, source")
async def catalog_status(state: State) -> CatalogStatus:
    return status_of(state)


@post(
    "/catalog/reload",
    status_code=200,
    summary="Build the catalog at `path` beside the served one, then swap it in",
)
async def catalog_reload(
    state: State, data: Annotated[CatalogReloadBody | None, Body()] = None
) -> CatalogStatus:
    engine = state.engine
    path = engine.catalogs.checked_path((data or CatalogReloadBody()).path)
    catalog = await offload(state, engine.catalogs.build, path)
    catalog_swap.install(engine, catalog, with_weights=False)  # labelled with the weights served
    return status_of(state)


@post(
    "/catalog/rollback",
    status_code=200,
    summary="Serve the catalog from before the last reload again",
)
async def catalog_rollback(
    state: State, data: Annotated[CatalogRollbackBody | None, Body()] = None
) -> CatalogStatus:
    catalog_swap.rollback(state.engine, force=(data or CatalogRollbackBody()).force)
    return status_of(state)


catalog_router = Router(
    path="/", guards=[catalog_reload_guard], route_handlers=[catalog_reload, catalog_rollback]
)
catalog_routes = [catalog_status, catalog_router]
