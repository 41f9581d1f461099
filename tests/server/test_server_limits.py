"""Auth, body limits, overload and timeouts, with an API key and small limits: the route contracts
in process (Litestar's test client); raw bodies over a socket, and the server's own log, on a
real `grctl serve`."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.support.appserver import AppServer
from tests.support.serverproc import ServerProc, assert_error

pytestmark = pytest.mark.timeout(120)

KEY = "s3cret-key"
LIMIT = 4096
GOOD = {"X-GR-API-Key": KEY}
LONG = {"max_new_tokens": 64, "n": 64, "ignore_eos": True}


FLAGS = ["--max-http-request-bytes", str(LIMIT), "--max-running-requests", "1"]
FLAGS += ["--max-waiting-requests", "2", "--generate-timeout-s", "0.3", "--log-requests"]
# one token: a default request runs to --max-new-tokens, which may pass the 0.3 s timeout
ONE = {"max_new_tokens": 1}
ONE_TOKEN = b'{"max_new_tokens": 1}}'
FLAGS += ["--log-format", "json"]
ENV = {"GR_HTTP_API_KEY": KEY}


@pytest.fixture(scope="module")
def srv(start_server) -> ServerProc:
    return start_server(*FLAGS, env=ENV)


@pytest.fixture(scope="module")
def app(start_app) -> AppServer:
    return start_app(*FLAGS, env=ENV)


@pytest.fixture(scope="module")
def http(app: AppServer):
    with app.client(headers=GOOD) as client:
        yield client


def raw_exchange(srv: ServerProc, head: str, body_parts: list[bytes], timeout: float = 5.0):
    """Send raw bytes and read the reply; returns (status, json body, seconds to answer)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as sock:
        sock.sendall(head.encode())
        for part in body_parts:
            sock.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), json.loads(payload), time.monotonic() - start


def test_startup_log_names_model_device_dtype_address(srv):
    log = srv.log_text()
    assert "serving model=grctl-builtin-gr device=cpu dtype=float32" in log
    assert srv.url in log and "API key required" in log


@pytest.mark.parametrize(
    "path", ["/health", "/ready", "/metrics", "/docs", "/openapi.json", "/schema/openapi.json"]
)
def test_health_ready_metrics_and_docs_need_no_key(app, path):  # /metrics: --metrics-auth
    with app.client() as anonymous:
        assert anonymous.get(path).status_code == 200


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/status"),
        ("POST", "/generate"),
        ("GET", "/get_model_info"),
        ("GET", "/server_info"),
        ("GET", "/flush_cache"),
        ("GET", "/poll/x"),
        ("POST", "/abort_request"),
        ("GET", "/v1/loads"),
    ],
)
def test_auth_matrix(app, method, path):
    def call(headers):
        with app.client() as client:
            return client.request(method, path, headers=headers, json={"input_ids": [1]})

    err = assert_error(call({}), 401, "unauthorized")
    assert "X-GR-API-Key" in err["message"]
    assert call({}).headers["www-authenticate"].startswith("Bearer")
    assert_error(call({"X-GR-API-Key": "wrong"}), 403, "forbidden")
    assert_error(call({"Authorization": "Bearer wrong"}), 403, "forbidden")
    assert_error(call({"Authorization": "Basic " + KEY}), 403, "forbidden")
    assert_error(call({"Authorization": "Bearer wrong", "X-GR-API-Key": KEY}), 403, "forbidden")
    for ok in (GOOD, {"Authorization": "Bearer " + KEY}, {"authorization": "bearer " + KEY}):
        assert call(ok).status_code not in (401, 403)


def test_oversize_content_length_refused_before_the_body(srv):
    head = (
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-GR-API-Key: {KEY}\r\nContent-Length: 100000000\r\n\r\n"
    )
    status, body, elapsed = raw_exchange(srv, head, [b'{"input_ids": ['])
    assert status == 413 and body["error"]["code"] == "payload_too_large"
    assert elapsed < 2.0  # answered without waiting for 100 MB that never come


def test_oversize_chunked_body_refused_while_reading(srv):
    head = (
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-GR-API-Key: {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"1000\r\n" + b" " * 0x1000 + b"\r\n"  # 4 KiB a chunk, never a final 0-chunk
    status, body, elapsed = raw_exchange(srv, head, [chunk, chunk])
    assert status == 413 and body["error"]["code"] == "payload_too_large" and elapsed < 2.0
    # httpx sends a generator body chunked too; a small one is read whole.
    resp = httpx.post(srv.url + "/generate", headers=GOOD, content=(b" " * 1024 for _ in range(8)))
    assert_error(resp, 413, "payload_too_large")
    small = (part for part in (b'{"input_ids": ', b'[1, 2], "sampling_params": ', ONE_TOKEN))
    assert httpx.post(srv.url + "/generate", headers=GOOD, content=small).status_code == 200


def test_body_just_under_the_limit_is_read(http):
    body = {"input_ids": [1, 2], "sampling_params": ONE, "padding": "x" * (LIMIT - 150)}
    assert len(json.dumps(body)) < LIMIT
    assert http.post("/generate", json=body).status_code == 200
    assert_error(http.post("/generate", json={**body, "more": "y" * 200}), 413, "payload_too_large")


def test_overloaded_and_generate_timeout(http):
    # One running slot and two waiting: a long request fills the engine, a short one then waits
    # past --generate-timeout-s (0.3 s) and is cancelled; the queue then overflows to 429.
    first = http.post("/submit", json={"input_ids": [1] * 16, "sampling_params": LONG})
    assert first.status_code == 202
    err = assert_error(http.post("/generate", json={"input_ids": [2]}), 504, "generate_timeout")
    assert err["retryable"] is True
    codes = [
        http.post("/submit", json={"input_ids": [3], "sampling_params": LONG}) for _ in range(6)
    ]
    overloaded = [r for r in codes if r.status_code == 429]
    assert overloaded, [r.status_code for r in codes]
    assert assert_error(overloaded[0], 429, "overloaded")["retryable"] is True
    http.post("/abort_request", json={"abort_all": True})


def test_a_batch_larger_than_the_waiting_queue_is_a_400_on_an_idle_server(http):
    """Three prompts can never be queued whole behind --max-waiting-requests 2: no retry could
    succeed, so it is not the retryable 429 of a queue that is full for now."""
    http.post("/abort_request", json={"abort_all": True})
    three = [[1], [2], [3]]
    err = assert_error(http.post("/generate", json={"input_ids": three}), 400, "validation_error")
    assert err["retryable"] is False and "--max-waiting-requests" in err["message"]
    many = {"requests": [{"input_ids": ids} for ids in three]}
    err = assert_error(http.post("/submit_many", json=many), 400, "validation_error")
    assert "(2, --max-waiting-requests)" in err["message"]
    two = http.post("/generate", json={"input_ids": three[:2], "sampling_params": ONE})
    assert two.status_code == 200 and len(two.json()) == 2


@pytest.mark.parametrize("server", ["app", "srv"])
def test_healthy_after_everything(request, server):
    srv = request.getfixturevalue(server)
    with srv.client(headers=GOOD) as http:
        deadline = time.monotonic() + 30
        while http.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, http.get("/ready").text
            time.sleep(0.05)
        assert http.get("/health").json() == {"ok": True}
        one = {"input_ids": [1, 2, 3], "sampling_params": ONE}
        assert http.post("/generate", json=one).status_code == 200
        assert_error(http.get("/poll/x"), 404, "not_found")


def test_one_log_line_per_request(srv):
    """--log-requests: a `request` event per request through the server's JSON log formatter
    (ts, level, logger like every other line), its route template too."""
    assert srv.proc.poll() is None
    docs = [json.loads(x) for x in srv.log_text().splitlines() if x.startswith("{")]
    lines = [x for x in docs if x.get("event") == "request"]
    assert lines and all(x["logger"] == "grctl.access" and x["level"] == "INFO" for x in lines)
    assert all({"ts", "method", "path", "route", "status", "ms"} <= set(x) for x in lines)
    assert any(x["path"] == "/generate" and x["status"] == 413 for x in lines)
    assert any(x["route"] == "/poll/{request_id}" for x in lines)
