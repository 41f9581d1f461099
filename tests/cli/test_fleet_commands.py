"""The fleet commands (pause, resume, flush, status, verify, catalog status) call every server at
once, as push does: over hung hosts (a socket that accepts and never answers) and one live
server, a command takes about one --timeout, not one per host, and the live server's reply is
there beside the hung hosts' timeouts."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.support.cli import grctl

pytestmark = pytest.mark.timeout(240)
TIMEOUT_S = 2.0
HUNG = 4


@pytest.fixture(scope="module")
def live(start_server, checkpoint):
    return start_server("--allow-weight-update", "--model-path", str(checkpoint(seed=0)))


@pytest.fixture(scope="module")
def hung() -> Iterator[list[str]]:
    """Hosts that accept a connection (the kernel completes it) and never answer a byte."""
    socks = []
    for _ in range(HUNG):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        socks.append(s)
    yield [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()


def timed(*args: str) -> tuple[float, dict, int]:
    t0 = time.monotonic()
    out = grctl(*args, "--timeout", str(TIMEOUT_S), "--json", timeout=120)
    return time.monotonic() - t0, json.loads(out.stdout), out.returncode


@pytest.mark.parametrize(
    "command",
    [
        ["pause", "--mode", "retract"],
        ["status"],
        # the same each_server: the default run keeps two of them
        pytest.param(["flush", "--retries", "1"], marks=pytest.mark.slow),
        pytest.param(["resume"], marks=pytest.mark.slow),
        pytest.param(["verify", "--checkpoint", "CKPT"], marks=pytest.mark.slow),
        pytest.param(["catalog", "status"], marks=pytest.mark.slow),
    ],
    ids=lambda c: c[0] if c[0] != "catalog" else "catalog-status",
)
def test_a_fleet_command_over_hung_hosts_takes_one_timeout(command, live, hung, checkpoint):
    command = [str(checkpoint(seed=0)) if a == "CKPT" else a for a in command]
    alone_s, alone, code = timed(*command, "--url", live.url)
    assert code == 0 and alone["ok"], alone
    urls = [*hung, live.url]  # the live one last: called in turn, it would wait for all the others
    fleet_s, doc, code = timed(*command, *[a for u in urls for a in ("--url", u)])
    assert code == 1 and not doc["ok"]
    by_url = {s["url"]: s for s in doc["servers"]}
    assert [s["url"] for s in doc["servers"]] == urls  # the order given
    assert by_url[live.url]["ok"], by_url[live.url]
    assert all(not by_url[u]["ok"] for u in hung)
    # Called in turn: HUNG timeouts more than alone (8 s); at once: about one (2 s).
    assert fleet_s - alone_s < 2 * TIMEOUT_S, (fleet_s, alone_s)
    assert fleet_s >= TIMEOUT_S  # the hung hosts were waited for, once
