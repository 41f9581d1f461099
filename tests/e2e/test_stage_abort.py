"""/abort_request (and /cancel) by the rid of a multi-stage request, on a real server: caught
inside its reasoning, between its stages (held there by grctl/testing/faults.py
GRCTL_FAULT_STAGE_HOLD) and inside its item beams. It ends "abort" at once, the stage after is
never run, the engine holds nothing of it afterwards, the beam group it was computing is gone
from the store, and an aborted item stage's groups carry no gumbel_threshold
(grctl.rl.estimators.whole_support_of refuses them rather than call them whole support)."""

from __future__ import annotations

import threading
import time

import pytest

from grctl.rl.estimators import whole_support_of
from tests.support.checkpoints import load_hf
from tests.support.reference import hf_token_logprobs

pytestmark = [pytest.mark.timeout(300)]

PROMPT, PREFIX, T1 = [5, 9, 2, 6], [3, 8], 0.7
LONG = 240  # tokens no stage reaches before the abort (the tiny model on a loaded CPU)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint(seed=0)


@pytest.fixture(scope="module")
def held(start_server, ckpt, tmp_path_factory):
    """A server holding every multi-stage group after its reasoning, until DIR/*.go exists."""
    where = tmp_path_factory.mktemp("abort-hold")
    env = {"GRCTL_FAULT_STAGE_HOLD": "after_reasoning", "GRCTL_FAULT_STAGE_HOLD_DIR": str(where)}
    srv = start_server("--model-path", str(ckpt), "--max-new-tokens", str(LONG), env=env)
    with srv.client(timeout=120) as http:
        yield where, http


def body(rid: str, reasoning: int = 4, items: int = LONG, **sp) -> dict:
    return {
        "rid": rid,
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {
            "reasoning": {
                "max_new_tokens": reasoning,
                "temperature": T1,
                "seed": 3,
                "ignore_eos": True,
            },
            "forced_prefix": {"ids": PREFIX},
            "n": 3,
            "temperature": 1.0,  # stochastic beams: Gumbel keys and a threshold
            "seed": 4,
            "max_new_tokens": items,
            "ignore_eos": True,
            "use_catalog": False,
            **sp,
        },
    }


def arm(where) -> None:
    for f in where.iterdir():
        f.unlink()


def wait_for(cond, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def steps(http) -> int:
    return http.get("/status").json()["scheduler"]["steps"]


def idle(http) -> bool:
    return http.get("/status").json()["scheduler"]["running"] == 0


def abort(http, rid: str) -> None:
    """Abort `rid` once the server knows it (an unknown rid aborts nothing, as SGLang's)."""
    deadline = time.monotonic() + 30
    while True:
        r = http.post("/abort_request", json={"rid": rid})
        assert r.status_code == 200, r.text
        if r.json()["num_aborted_requests"] == 1:
            return
        assert time.monotonic() < deadline, f"{rid} was never running"
        time.sleep(0.01)


def test_an_abort_inside_the_reasoning_ends_it_before_the_items(held, ckpt):
    where, http = held
    (where / "after_reasoning.go").write_text("")  # nothing held: the stages run on
    out: list = []
    b = body("ab-r1", reasoning=LONG, items=2)
    t = threading.Thread(target=lambda: out.append(http.post("/generate", json=b)))
    start = steps(http)
    t.start()
    wait_for(lambda: steps(http) >= start + 3, "the reasoning never ran")
    abort(http, "ab-r1")
    t.join(60)
    assert out and out[0].status_code == 200, out and out[0].text
    meta = out[0].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["beam_results"] == []
    (g,) = meta["stage_groups"]
    assert g["reasoning_finish_reason"] == "abort" and g["num_beams"] == 0
    assert 0 < len(g["reasoning_ids"]) < LONG  # cut inside the reasoning
    # what it did sample is the behaviour policy's: transformers' logprob, summed
    ref = hf_token_logprobs(load_hf(ckpt), PROMPT + g["reasoning_ids"], len(PROMPT), T1)
    assert g["reasoning_logprob"] == pytest.approx(sum(ref), abs=1e-4)
    assert "gumbel_threshold" not in meta
    wait_for(lambda: idle(http), "a stage request still runs")
    # the rid is free again, as a finished request's
    assert http.post("/abort_request", json={"rid": "ab-r1"}).json()["num_aborted_requests"] == 0


def test_an_abort_between_the_stages_runs_no_items(held):
    where, http = held
    arm(where)
    r = http.post("/submit", json=body("ab-b1", items=2))
    assert r.status_code == 202, r.text
    wait_for(lambda: (where / "after_reasoning.held").exists(), "never held")
    start = steps(http)
    abort(http, "ab-b1")
    (where / "after_reasoning.go").write_text("")
    got = http.get("/result/ab-b1", params={"timeout": 60})
    assert got.status_code == 200, got.text
    meta = got.json()["meta_info"]
    (g,) = meta["stage_groups"]
    assert len(g["reasoning_ids"]) == 4  # the reasoning ran whole, then nothing
    assert meta["beam_results"] == [] and meta["finish_reason"]["type"] == "abort"
    assert g["reasoning_finish_reason"] == "abort" and g["num_beams"] == 0
    assert steps(http) == start  # the item stage never ran a step


def test_an_abort_inside_the_items_keeps_no_threshold(held):
    where, http = held
    arm(where)
    r = http.post("/submit", json=body("ab-i1"))
    assert r.status_code == 202, r.text
    wait_for(lambda: (where / "after_reasoning.held").exists(), "never held")
    start = steps(http)
    (where / "after_reasoning.go").write_text("")
    wait_for(lambda: steps(http) >= start + 3, "the item stage never ran")
    r = http.post("/cancel", json={"rid": "ab-i1"})  # /cancel reaches it too
    assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
    got = http.get("/result/ab-i1", params={"timeout": 60})
    assert got.status_code == 200, got.text
    meta = got.json()["meta_info"]
    (g,) = meta["stage_groups"]
    assert len(g["reasoning_ids"]) == 4 and g["num_beams"] == 3
    for b in meta["beam_results"]:
        bm = b["meta_info"]
        assert bm["finish_reason"]["type"] == "abort"
        searched = bm["stage_spans"][-1]
        assert searched["kind"] == "searched" and 0 < searched["end"] - searched["start"] < LONG
        assert bm["gumbel_key"] is not None
    # partial beams are no sample without replacement of anything: no threshold, and the
    # estimators' reader refuses both the reply and the group rather than call them whole
    assert "gumbel_threshold" not in meta and "gumbel_threshold" not in g
    for what in (meta, g):
        with pytest.raises(ValueError, match="aborted"):
            whole_support_of(what)
    wait_for(lambda: idle(http), "a stage request still runs")
    # the same request run to its end: a threshold (a float: 3 of far more paths drawn)
    (where / "after_reasoning.go").write_text("")
    whole = http.post("/generate", json=body("ab-i2", items=3))
    assert whole.status_code == 200, whole.text
    wm = whole.json()["meta_info"]
    assert isinstance(wm["stage_groups"][0]["gumbel_threshold"], float)
    assert whole_support_of(wm) is False and whole_support_of(wm["stage_groups"][0]) is False


@pytest.mark.parametrize("naming", ["own rids", "verl-GR's"])
def test_an_abort_clears_the_beam_group_it_computes(held, naming):
    """verl-GR names every call of a group by the group's id (its agent loop's request_id):
    the calls share it, and an abort of it reaches all of them."""
    where, http = held
    arm(where)
    gid = f"ab-grp-{len(naming)}"
    grp = {"beam_group_id": gid, "beam_index": 0}
    rids = ["ab-g0", "ab-g1"] if naming == "own rids" else [gid, gid]
    out: list = []
    b = body(rids[0], **grp)
    t = threading.Thread(target=lambda: out.append(http.post("/generate", json=b)))
    t.start()
    wait_for(lambda: (where / "after_reasoning.held").exists(), "never held")
    # a second call of the group waits for the first's computation
    late: list = []
    b1 = body(rids[1], **{**grp, "beam_index": 1})
    t1 = threading.Thread(target=lambda: late.append(http.post("/generate", json=b1)))
    t1.start()
    if naming == "verl-GR's":  # both calls are known under the one id before the abort
        time.sleep(0.5)
    abort(http, rids[1])  # aborting the waiting call stops the group's computation
    (where / "after_reasoning.go").write_text("")
    t.join(60)
    t1.join(60)
    for reply in (out, late):
        assert reply and reply[0].status_code == 200, reply and reply[0].text
        meta = reply[0].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["beam_results"] == []
    # the group is gone: the id may name another request (a kept group would be a 409)
    other = body(f"ab-g2-{len(naming)}", items=2, **grp)
    other["input_ids"] = PROMPT + [7]
    r = http.post("/generate", json=other)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"]["type"] != "abort"
