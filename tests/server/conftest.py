"""The session's server on the built-in model, weight routes on (for pauses): the default `srv`
of the modules here that set none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.serverproc import ServerProc, running_server


@pytest.fixture(scope="session")
def builtin_server() -> Iterator[ServerProc]:
    with running_server("--allow-weight-update", "--max-http-submit-many", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def srv(builtin_server: ServerProc) -> ServerProc:
    return builtin_server
