"""One policy per multi-stage sample, on a real server: a weight write forced at each stage
boundary (grctl/testing/faults.py GRCTL_FAULT_STAGE_HOLD), under every pause mode, and one
landing inside a stage. Every beam's tokens carry one version, and its behaviour logprobs equal
transformers' on the checkpoint that version names: a write before stage 2 restarts the group on
the new weights, one after it changes nothing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import load_hf, write_checkpoint
from tests.support.reference import hf_token_logprobs

pytestmark = [pytest.mark.timeout(300)]

PROMPT, PREFIX, T1 = [5, 9, 2, 6], [3, 8], 0.7
MODES = ("abort", "retract", "in_place")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stage-versions")
    return {"A": write_checkpoint(root / "A", seed=41), "B": write_checkpoint(root / "B", seed=42)}


@pytest.fixture(scope="module")
def hf(ckpts):
    return {k: load_hf(v) for k, v in ckpts.items()}


@pytest.fixture(scope="module", params=["before_reasoning", "after_reasoning", "after_items"])
def held(request, start_server, ckpts, tmp_path_factory):
    where = tmp_path_factory.mktemp(f"hold-{request.param}")
    env = {"GRCTL_FAULT_STAGE_HOLD": request.param, "GRCTL_FAULT_STAGE_HOLD_DIR": str(where)}
    args = ("--model-path", str(ckpts["A"]), "--weight-version", "A", "--allow-weight-update")
    srv = start_server(*args, env=env)
    with srv.client(timeout=120) as http:
        yield request.param, where, http


def body(max_new: int = 6) -> dict:
    return {
        "input_ids": PROMPT,
        "sampling_params": {
            "reasoning": {"max_new_tokens": max_new, "temperature": T1, "seed": 3},
            "forced_prefix": {"ids": PREFIX},
            "n": 3,
            "max_new_tokens": 3,
            "use_catalog": False,
        },
    }


def update(http, ckpts, label: str, **kw) -> None:
    resp = http.post(
        "/update_weights_from_disk",
        json={"model_path": str(ckpts[label]), "weight_version": label, **kw},
    )
    assert resp.status_code == 200, resp.text


def check_one_version(meta: dict, version: str, model) -> None:
    assert meta["beam_results"], meta
    for b in meta["beam_results"]:
        bm, ids = b["meta_info"], b["output_ids"]
        assert bm["weight_versions"] == [{"version": version, "start": 0, "end": len(ids)}]
        ref = hf_token_logprobs(model, PROMPT + ids, len(PROMPT))
        spans = {s["kind"]: (s["start"], s["end"]) for s in bm["stage_spans"]}
        r, (f0, f1) = spans["sampled"][1], spans["forced"]
        sampled = hf_token_logprobs(model, PROMPT + ids, len(PROMPT), T1)[:r]
        assert bm["behaviour_logprobs"][:r] == pytest.approx(sampled, abs=1e-5)
        assert bm["behaviour_logprobs"][f1:] == pytest.approx(ref[f1:], abs=1e-5)
        assert bm["behaviour_logprobs"][f0:f1] == [None] * (f1 - f0)
    for g in meta["stage_groups"]:
        assert g["weight_version"] == version


@pytest.mark.parametrize("mode", MODES)
def test_a_write_at_a_stage_boundary_never_joins_two_versions(held, mode, ckpts, hf):
    boundary, where, http = held
    http.post("/continue_generation")
    update(http, ckpts, "A", abort_all_requests=True)
    for f in where.iterdir():
        f.unlink()
    out: list = []
    t = threading.Thread(target=lambda: out.append(http.post("/generate", json=body())))
    t.start()
    deadline = time.monotonic() + 60
    while not (where / f"{boundary}.held").exists():
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.01)
    assert http.post("/pause_generation", json={"mode": mode}).status_code == 200
    update(http, ckpts, "B")
    http.post("/continue_generation").raise_for_status()
    (where / f"{boundary}.go").write_text("")
    t.join(120)
    assert out and out[0].status_code == 200, out and out[0].text
    meta = out[0].json()["meta_info"]
    if boundary == "after_items":  # the group was whole on A before the write
        assert meta["stage_restarts"] == 0
        check_one_version(meta, "A", hf["A"])
    else:  # between the stages: restarted on B; before stage 1: all on B from the start
        assert meta["stage_restarts"] == (1 if boundary == "after_reasoning" else 0)
        check_one_version(meta, "B", hf["B"])


BURST = {
    "input_ids": [i % 120 + 3 for i in range(200)],
    "sampling_params": {"max_new_tokens": 16, "n": 16, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def plain(start_server, ckpts):
    args = ("--model-path", str(ckpts["A"]), "--weight-version", "A", "--allow-weight-update")
    with start_server(*args).client(timeout=120) as http:
        yield http


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_write_inside_the_reasoning_restarts_the_group(plain, mode, ckpts, hf):
    http = plain
    http.post("/continue_generation")
    update(http, ckpts, "A", abort_all_requests=True)
    long = body(max_new=40)
    long["sampling_params"]["reasoning"]["ignore_eos"] = True
    steps = http.get("/status").json()["scheduler"]["steps"]
    out: list = []
    t = threading.Thread(target=lambda: out.append(http.post("/generate", json=long)))
    t.start()
    burst = [http.post("/submit", json=BURST).json()["request_id"] for _ in range(2)]
    deadline = time.monotonic() + 60
    while http.get("/status").json()["scheduler"]["steps"] < steps + 3:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert http.post("/pause_generation", json={"mode": mode}).status_code == 200
    update(http, ckpts, "B")
    http.post("/continue_generation").raise_for_status()
    t.join(120)
    for rid in burst:
        assert http.get(f"/result/{rid}", params={"timeout": 120}).status_code == 200
    assert out and out[0].status_code == 200, out and out[0].text
    meta = out[0].json()["meta_info"]
    assert meta["stage_restarts"] >= 1  # it was inside stage 1 when the weights changed
    check_one_version(meta, "B", hf["B"])
