"""The OpenAPI document and its UI, served without any network access, and the error entries
routes declare in it.

GET /openapi.json (also /schema/openapi.json) is the document; GET /docs is Swagger UI, whose
scripts and styles come from the swagger-ui-bundle package and are served here under
/docs/assets, so the page renders on an air-gapped machine (Litestar's defaults load them from
a CDN). Neither needs the API key: the document describes routes, it exposes no data.

Litestar's OpenAPI router also adds a GET `/{path:str}` that answers an HTML 404 page: mounted
at the root, it would catch every unknown one-segment route (an unknown POST then answered 405).
DocsRouter leaves it out, so an unknown route is Litestar's own 404, in grctl's error shape.
"""

from __future__ import annotations

from typing import Any

from litestar import Router
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.static_files import create_static_files_router
from swagger_ui_bundle import swagger_ui_path

import grctl
from grctl.errors import NotFound
from grctl.protocol.info import ErrorResponse

ASSETS = "/docs/assets"
EXEMPT = {"auth_exempt": True}

ERROR_DESCRIPTIONS = {
    400: "validation_error",
    404: "not_found",
    409: "duplicate_request_id",
    413: "payload_too_large",
    429: "overloaded (retryable)",
    503: "paused, weights_inconsistent or memory_released (retryable)",
    504: "generate_timeout (retryable)",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI entries for the errors a route can answer, all in the one error shape."""
    return {
        s: ResponseSpec(data_container=ErrorResponse, description=ERROR_DESCRIPTIONS[s])
        for s in statuses
    }


class DocsRouter(Router):
    """The router the OpenAPI plugin fills, without its catch-all 404 page."""

    def register(self, value: Any) -> list:
        if "/{path:str}" in getattr(value, "paths", ()):
            return []
        return super().register(value)


def openapi_config() -> OpenAPIConfig:
    swagger = SwaggerRenderPlugin(
        path="/docs",
        js_url=f"{ASSETS}/swagger-ui-bundle.js",
        css_url=f"{ASSETS}/swagger-ui.css",
        standalone_preset_js_url=f"{ASSETS}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' type='image/png' href='{ASSETS}/favicon-32x32.png'>",
    )
    return OpenAPIConfig(
        title="grctl",
        version=grctl.__version__,
        render_plugins=[swagger, JsonRenderPlugin(path=["/openapi.json", "/schema/openapi.json"])],
        openapi_router=DocsRouter(path="/", route_handlers=[], opt=EXEMPT, include_in_schema=False),
    )


def plain_asset_name(connection, _handler) -> None:
    """A name no file system holds (a segment over 255 bytes) is a 404, not the 500 of the
    static files router's OSError (ENAMETOOLONG)."""
    name = str(connection.path_params.get("file_path", ""))
    if len(name) > 1024 or any(len(part.encode()) > 255 for part in name.split("/")):
        raise NotFound("no such asset", hint=f"the page at /docs loads its files from {ASSETS}")


def swagger_assets() -> Router:
    return create_static_files_router(
        path=ASSETS,
        directories=[swagger_ui_path],
        opt=EXEMPT,
        include_in_schema=False,
        guards=[plain_asset_name],
    )
