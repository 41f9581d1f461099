"""The session's servers on the built-in model, weight routes on (for pauses): `builtin_app` in
this process for route contracts (the default `srv` here), `builtin_server` a real `grctl serve`
for what crosses processes (concurrent connections, disconnects)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.appserver import AppServer, app_server
from tests.support.serverproc import ServerProc, running_server


@pytest.fixture(scope="session")
def builtin_app() -> Iterator[AppServer]:
    with app_server("--allow-weight-update", "--max-http-submit-many", "4") as srv:
        yield srv


@pytest.fixture(scope="session")
def builtin_server() -> Iterator[ServerProc]:
    with running_server("--allow-weight-update", "--max-http-submit-many", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def srv(builtin_app: AppServer) -> AppServer:
    return builtin_app
