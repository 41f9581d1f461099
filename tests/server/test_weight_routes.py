"""Weight routes' contracts in process on the built-in model (Litestar's test client): a pause
gates generation, a malformed tensor push is a 400. The updates themselves run on real servers
(tests/e2e)."""

from __future__ import annotations

import pytest

from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(120)


def test_pause_makes_generation_503_until_continue(http):
    assert http.post("/pause_generation").json()["mode"] == "abort"  # empty body: abort
    body = {"input_ids": [1, 2, 3]}
    for route, payload in (
        ("/generate", body),
        ("/submit", body),
        ("/submit_many", {"requests": [body]}),
    ):
        err = assert_error(http.post(route, json=payload), 503, "paused")
        assert err["retryable"] is True
    ready = http.get("/ready")
    assert ready.status_code == 503 and "paused" in ready.json()["reasons"]
    assert_error(http.post("/pause_generation", json={"mode": "sideways"}), 400, "validation_error")
    http.post("/continue_generation")
    assert http.get("/ready").status_code == 200
    assert http.post("/generate", json=body).status_code == 200


def test_malformed_request_bodies(http):
    for body in (
        {},
        {"serialized_named_tensors": []},
        {"serialized_named_tensors": "abc"},
        {"serialized_named_tensors": [5]},
    ):
        assert_error(http.post("/update_weights_from_tensor", json=body), 400, "validation_error")
