"""Hostile tensor payloads against a real server, timed as a user sees them: each one the scan
bounds is a 400 at once, /health answers while the worst accepted one decodes, and no payload
changes what later pushes meet (docs/security.md)."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import pytest
import torch

from grctl.weights.wire.encode import encode_bucket
from tests.support import hostile_pickles as h
from tests.support.weight_helpers import served_sha256

pytestmark = pytest.mark.timeout(300)

# The slowest stream the scan lets through a 1 MiB body: 78,000 small tuples, with a call into
# Python (find_class) after every 1,300 so that the C unpickler lets other threads in.
_CHUNK = (h.s("w") + h.i(1) + b"\x86") * 1300
WORST_ACCEPTED = h.done(b"](" + (_CHUNK + h.glob("torch", "Size") + b"0") * 60 + b"e")


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--allow-weight-update")


def push(http: httpx.Client, payload: bytes, load_format: str | None = None) -> httpx.Response:
    entry = base64.b64encode(payload).decode()
    body = {"serialized_named_tensors": [entry], "load_format": load_format}
    return http.post("/update_weights_from_tensor", json=body)


@pytest.mark.parametrize("name", sorted(h.BOUNDS))
def test_each_bounded_payload_is_a_400_at_once(http, name):
    start = time.perf_counter()
    resp = push(http, h.BOUNDS[name])
    elapsed = time.perf_counter() - start
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["error"]["code"] == "validation_error"
    assert elapsed < 1.0, f"{elapsed:.2f} s over HTTP (in process the bound is 50 ms)"
    assert http.get("/health", timeout=1.0).status_code == 200


def worst_health_latency(url: str, action) -> float:
    """The slowest /health answer (s) among those polled, every 10 ms, while `action` ran, and
    the first one after it (a refusal may take less than one poll's interval)."""
    polls: list[tuple[float, float]] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                client.get("/health")
                polls.append((start, time.perf_counter()))
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    begin = time.perf_counter()
    action()
    end = time.perf_counter()
    deadline = time.monotonic() + 30
    while not any(start >= end for start, _ in polls) and time.monotonic() < deadline:
        time.sleep(0.005)
    done.set()
    poller.join()
    return max(stop - start for start, stop in polls if stop > begin)


@pytest.mark.parametrize(
    "payload",
    [h.BOUNDS["shared_lists_in_a_message"], WORST_ACCEPTED],
    ids=["nested_lists_2.7s_before", "worst_accepted_1MiB"],
)
def test_health_answers_within_100ms_while_a_payload_decodes(srv, http, payload):
    """Timing on a shared machine is noisy: the best of three tries must make it. Before the
    fix every try of the nested payload held the GIL for seconds."""
    worst = []
    for _ in range(3):
        worst.append(worst_health_latency(srv.url, lambda: push(http, payload)))
        if worst[-1] < 0.1:
            break
    assert min(worst) < 0.1, f"/health took {[round(w, 3) for w in worst]} s"


def test_build_on_an_allowed_global_leaves_later_pushes_working(http):
    """It rewrote rebuild_storage_filename's defaults: every later CPU push was refused."""
    before = served_sha256(http)
    assert push(http, h.BOUNDS["build_defaults_on_an_allowed_function"]).status_code == 400
    query = {"name": "model.norm.weight", "truncate_size": 1 << 20}
    norm = http.post("/get_weights_by_name", json=query).json()
    keep: list = []
    entry = encode_bucket([("model.norm.weight", torch.tensor(norm["parameter"]))], keep)
    body = {"serialized_named_tensors": [entry], "load_format": "flattened_bucket"}
    resp = http.post("/update_weights_from_tensor", json=body)
    assert resp.status_code == 200, resp.text[:300]
    assert served_sha256(http) == before  # the same values, pushed through shared memory
