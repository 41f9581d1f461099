"""Weight routes' contracts in process on the built-in model (Litestar's test client): a pause
gates generation, a malformed tensor push is a 400. The updates themselves run on real servers
(tests/e2e)."""

from __future__ import annotations

import pytest

from grctl.weights import tensor
from grctl.weights.wire.encode import encode_bucket
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


def test_selector_names_the_one_model(http):
    """SGLang's runner selector: "all" and "target" are grctl's model; it has no draft."""
    for route, body in (
        ("/begin_weight_update", {}),
        ("/weights_checker", {"action": "checksum"}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
        ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    ):
        err = assert_error(
            http.post(route, json={**body, "selector": "draft"}), 400, "validation_error"
        )
        assert "draft" in err["message"], route
    assert http.post("/begin_weight_update", json={"selector": "target"}).status_code == 200
    assert http.post("/end_weight_update", json={}).status_code == 200
    assert http.post("/weights_checker", json={"selector": "target"}).json()["ranks"]


def test_weights_checker_bodies(http):
    """SGLang 0.5.23: action defaults to checksum, GET or POST; bad bodies are 400s."""
    by_get = http.get("/weights_checker").json()
    assert by_get["ranks"][0]["parallelism_info"] == [
        {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
         "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}
    ]  # fmt: skip
    assert http.post("/weights_checker").json()["ranks"] == by_get["ranks"]
    assert by_get["ranks"][0]["checksums"] == {k: v["sha256"] for k, v in by_get["tensors"].items()}
    for body in ({"action": None}, {"skip_tensor_list": "lm_head"}, {"action": "explode"}):
        reply = http.post("/weights_checker", json=body)
        assert_error(reply, 400, "validation_error")
        assert reply.json()["success"] is False


def test_an_update_reports_the_label_it_wrote(http, srv, monkeypatch):
    """Another update (here a relabel) landing between this update's end and its reply does not
    change what the reply says: the label and step this update wrote."""
    real = tensor.update_from_tensor
    updater = srv.app.state.updater

    def then_another(*args, **kw):
        outcome = real(*args, **kw)
        updater.set_version("theirs")
        return outcome

    monkeypatch.setattr(tensor, "update_from_tensor", then_another)
    body = {
        "serialized_named_tensors": [encode_bucket([])],
        "load_format": "flattened_bucket",
        "weight_version": "mine",
        "token_step": 7,
    }
    try:
        reply = http.post("/update_weights_from_tensor", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["weight_version"] == "mine" and reply.json()["token_step"] == 7
        assert http.get("/get_weight_version").json()["weight_version"] == "theirs"
    finally:
        updater.set_version("default")
