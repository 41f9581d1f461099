"""grctl's app served in this process by Litestar's test client, for route contracts.

    with app_server("--api-key", "k", "--allow-weight-update") as srv, srv.client() as http:
        assert_error(http.get("/status"), 401, "unauthorized")

It takes what running_server (serverproc.py) takes: `grctl serve`'s own flags and GR_* variables
make the ServeConfig (the command runs with the server itself captured, as
tests/cli/test_server_cli.py does), the engine is built as `grctl serve` builds it, then
create_app(engine, config). The test client runs the app's lifespan: the engine's worker thread
starts on entry and is drained and stopped on exit. srv.client() gives httpx clients over that
one app, as ServerProc.client() does over a real server, so a test reads the same either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import httpx
from litestar import Litestar
from litestar.testing import TestClient
from litestar.testing.transport import TestClientTransport
from typer.testing import CliRunner

import grctl.server.serve as serve_module
from grctl.cli import app as cli_app
from grctl.config import ServeConfig
from grctl.engine.engine import Engine
from grctl.server.app import create_app

BASE_URL = "http://127.0.0.1"


def serve_config(*flags: str, env: dict[str, str] | None = None) -> ServeConfig:
    """The ServeConfig `grctl serve *flags` builds (on the CPU unless --device says otherwise)."""
    if not any(a == "--device" or a.startswith("--device=") for a in flags):
        flags = (*flags, "--device", "cpu")
    seen: list[ServeConfig] = []
    with mock.patch.object(serve_module, "serve", seen.append):
        result = CliRunner().invoke(cli_app, ["serve", *flags], env=env)
    assert result.exit_code == 0 and seen, result.output
    return seen[0]


class AppTransport(httpx.BaseTransport):
    """httpx's transport interface over the test client's (which lacks the context manager)."""

    def __init__(self, test_client: TestClient):
        self.inner = TestClientTransport(test_client)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(request)


@dataclass
class AppServer:
    config: ServeConfig
    engine: Engine
    app: Litestar
    test_client: TestClient
    url: str = BASE_URL

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(transport=AppTransport(self.test_client), base_url=self.url, **kw)


@contextmanager
def app_server(*flags: str, env: dict[str, str] | None = None) -> Iterator[AppServer]:
    """The app over a new engine, started; stopped (engine and threads) when the block ends."""
    config = serve_config(*flags, env=env)
    engine = serve_module.build_engine(config)
    app = create_app(engine, config)
    if config.catalog is not None:  # as `grctl serve` loads --catalog
        engine.catalogs.load(config.catalog, confine=False)
    with TestClient(app, base_url=BASE_URL) as test_client:
        yield AppServer(config, engine, app, test_client)
