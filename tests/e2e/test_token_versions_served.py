"""Per-token weight versions on a real server, mid-request: meta_info.weight_versions spans
(SGLang's shape) across an in_place pause with a disk update, a relabel, a retract with an
update and a resume, an abort; the tokens on each side of a span's edge checked against
transformers on the checkpoint the span names.

A burst of wide requests keeps every step slow enough that the pause, sent once the probe has
run a few steps, lands in the middle of it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.checkpoints import load_hf, write_checkpoint
from tests.support.reference import hf_generate

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

PROBE = [5, 9, 2, 6, 11, 4]
NEW = 16
BURST = {
    "input_ids": [i % 120 + 3 for i in range(200)],
    "sampling_params": {"max_new_tokens": NEW, "n": 16, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("token-versions")
    return {"A": write_checkpoint(root / "A", seed=41), "B": write_checkpoint(root / "B", seed=42)}


@pytest.fixture(scope="module")
def hf(ckpts):
    return {k: load_hf(v) for k, v in ckpts.items()}


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    args = ("--model-path", str(ckpts["A"]), "--weight-version", "A")
    return start_server("--allow-weight-update", *args)


@pytest.fixture
def at_a(http, ckpts):
    """Each test starts unpaused on A."""
    http.post("/continue_generation")
    body = {"model_path": str(ckpts["A"]), "weight_version": "A", "abort_all_requests": True}
    assert http.post("/update_weights_from_disk", json=body).status_code == 200


def probe_body(n: int = 1) -> dict:
    return {"input_ids": PROBE, "sampling_params": {"max_new_tokens": NEW, "n": n}}


def start_mid_request(http, n: int = 1) -> tuple[str, list[str]]:
    """The probe, then a burst behind it; returns once a few steps have run with the probe."""
    steps = http.get("/status").json()["scheduler"]["steps"]
    probe = http.post("/submit", json=probe_body(n)).json()["request_id"]
    burst = [http.post("/submit", json=BURST).json()["request_id"] for _ in range(2)]
    deadline = time.monotonic() + 60
    while http.get("/status").json()["scheduler"]["steps"] < steps + 2:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return probe, burst


def result(http, rid: str) -> dict:
    resp = http.get(f"/result/{rid}", params={"timeout": 120})
    assert resp.status_code == 200, resp.text
    return resp.json()


def spans(meta: dict) -> list[tuple[str, int, int]]:
    return [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]]


def update(http, ckpts, label: str) -> None:
    body = {"model_path": str(ckpts[label]), "weight_version": label}
    resp = http.post("/update_weights_from_disk", json=body)
    assert resp.status_code == 200, resp.text


def test_retract_update_resume_recomputes_and_continues_on_the_new_weights(http, at_a, ckpts, hf):
    probe, burst = start_mid_request(http)
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    assert http.get("/flush_cache").status_code == 200
    update(http, ckpts, "B")
    http.post("/continue_generation").raise_for_status()
    out = result(http, probe)
    meta, ids = out["meta_info"], out["output_ids"]
    (a, _, k), (b, _, end) = spans(meta)
    assert (a, b, end) == ("A", "B", NEW) and 0 < k < NEW, spans(meta)
    assert ids[:k] == hf_generate(hf["A"], PROBE, k)
    assert ids[k:] == hf_generate(hf["B"], PROBE + ids[:k], NEW - k)
    assert meta["num_retractions"] == 1 and meta["kv_recomputed_at"] == [k]
    assert meta["weight_version"] == "B" and meta["finish_reason"]["type"] == "length"
    for rid in burst:
        assert result(http, rid)["meta_info"]["finish_reason"]["type"] == "length"


def test_in_place_update_spans_every_beam_at_the_same_step(http, at_a, ckpts, hf):
    probe, burst = start_mid_request(http, n=4)
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    update(http, ckpts, "B")
    http.post("/continue_generation").raise_for_status()
    meta = result(http, probe)["meta_info"]
    (a, _, k), (b, _, end) = spans(meta)
    assert (a, b, end) == ("A", "B", NEW) and 0 < k < NEW
    for beam in meta["beam_results"]:  # every beam's position t: step t's version
        n = len(beam["output_ids"])
        assert spans(beam["meta_info"]) == [("A", 0, k), ("B", k, n)]
    assert "kv_recomputed_at" not in meta and meta["num_retractions"] == 0
    for rid in burst:
        result(http, rid)


def test_a_relabel_mid_request_splits_the_spans_and_changes_no_token(http, at_a, hf):
    probe, burst = start_mid_request(http)
    resp = http.post("/update_weight_version", json={"new_version": "A2"})
    assert resp.status_code == 200, resp.text
    out = result(http, probe)
    (a, _, k), (a2, _, end) = spans(out["meta_info"])
    assert (a, a2, end) == ("A", "A2", NEW) and 0 < k < NEW
    assert out["output_ids"] == hf_generate(hf["A"], PROBE, NEW)
    for rid in burst:
        result(http, rid)


def test_an_aborted_request_spans_the_tokens_it_returns(http, at_a, hf):
    probe, _ = start_mid_request(http)
    assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    out = result(http, probe)
    meta, ids = out["meta_info"], out["output_ids"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < len(ids) < NEW
    assert spans(meta) == [("A", 0, len(ids))]
    assert ids == hf_generate(hf["A"], PROBE, len(ids))
