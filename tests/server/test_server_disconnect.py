"""A /generate whose HTTP client goes away cancels its engine requests on a real server:
nothing keeps computing for a reply nobody will read."""

from __future__ import annotations

import json
import socket
import time

import pytest

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def srv(builtin_server):
    return builtin_server  # a real server: the client's socket closes


# Slow on purpose: a batch of wide beams over many tokens keeps the engine busy for seconds.
BODY = {
    "input_ids": [[(p * 31 + j) % 250 + 3 for j in range(200)] for p in range(8)],
    "sampling_params": {"max_new_tokens": 64, "n": 64, "ignore_eos": True},
}


def in_flight(http) -> int:
    sched = http.get("/status").json()["scheduler"]
    return sched["num_running"] + sched["num_waiting"]


def test_a_client_that_disconnects_cancels_its_generate(srv, http):
    aborted = http.get("/status").json()["requests"]["aborted"]
    raw = json.dumps(BODY).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(head + raw)
        deadline = time.monotonic() + 30
        while in_flight(http) < len(BODY["input_ids"]):  # every request is in the engine
            assert time.monotonic() < deadline
            time.sleep(0.02)
    t0 = time.monotonic()  # the client is gone
    while in_flight(http) > 0:
        assert time.monotonic() - t0 < 10, "the engine kept computing for a closed connection"
        time.sleep(0.05)
    status = http.get("/status").json()["requests"]
    assert status["aborted"] - aborted == len(BODY["input_ids"])
    assert (
        http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {}}).status_code == 200
    )
