"""Weight sync part 1 on a real server: coordination routes, the disk path, versions, refusals;
the weight routes turned off, and their API key, in process (Litestar's test client)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.appserver import app_server
from tests.support.checkpoints import load_hf, write_checkpoint
from tests.support.reference import hf_generate
from tests.support.serverproc import assert_error
from tests.support.weight_helpers import (
    PROMPTS,
    checkpoint_sha256,
    flush_until_ok,
    served_greedy,
    served_sha256,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("disk-sync")
    base = write_checkpoint(root / "base", seed=11)
    new = write_checkpoint(root / "new", seed=12, max_shard_size="40KB")
    assert (new / "model.safetensors.index.json").is_file()
    return {"root": root, "base": base, "new": new}


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    args = ("--model-path", str(ckpts["base"]), "--weights-root", str(ckpts["root"]))
    return start_server("--allow-weight-update", *args)


def restore(http, path: Path, version: str = "base") -> None:
    resp = http.post(
        "/update_weights_from_disk", json={"model_path": str(path), "weight_version": version}
    )
    assert resp.status_code == 200, resp.text


def test_guide_flow_swaps_to_sharded_checkpoint_and_back(http, ckpts):
    before = {tuple(p): served_greedy(http, p)["output_ids"] for p in PROMPTS}
    for p in PROMPTS:
        assert before[tuple(p)] == hf_generate(ckpts["base"], p)
    resp = http.post("/pause_generation", json={"mode": "abort"})
    assert resp.status_code == 200 and resp.json() == {
        "paused": True,
        "mode": "abort",
        "num_aborted_requests": 0,
    }
    flush_until_ok(http)
    resp = http.post(
        "/update_weights_from_disk",
        json={"model_path": str(ckpts["new"]), "weight_version": "plus1", "token_step": 5},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True and body["weight_version"] == "plus1"
    assert body["token_step"] == 5 and body["model_dir"] == str(ckpts["new"])
    assert body["tensors_loaded"] == len(checkpoint_sha256(ckpts["new"]))
    assert body["flushed_cache"] is True and body["num_aborted_requests"] == 0
    assert body["elapsed_ms"] > 0 and "Succeeded" in body["message"]
    assert http.post("/continue_generation").json() == {"paused": False}
    for p in PROMPTS:
        out = served_greedy(http, p)
        assert out["output_ids"] == hf_generate(ckpts["new"], p)
        assert out["meta_info"]["weight_version"] == "plus1"
        assert out["meta_info"]["weight_versions"] == [
            {"version": "plus1", "start": 0, "end": len(out["output_ids"])}
        ]
    assert served_sha256(http) == checkpoint_sha256(ckpts["new"])
    # Swap back: the original outputs, exactly.
    restore(http, ckpts["base"])
    for p in PROMPTS:
        assert served_greedy(http, p)["output_ids"] == before[tuple(p)]
    assert served_sha256(http) == checkpoint_sha256(ckpts["base"])


def test_version_bookkeeping(http, ckpts):
    v0 = http.get("/get_weight_version").json()
    restore(http, ckpts["base"], version="7")
    v1 = http.get("/get_weight_version").json()
    assert v1["weight_version"] == "7"
    assert v1["weight_update_count"] == v0["weight_update_count"] + 1
    # Omitted version and step keep their values; an int version is kept as a string.
    resp = http.post(
        "/update_weights_from_disk", json={"model_dir": str(ckpts["base"]), "token_step": 3}
    )
    assert resp.status_code == 200 and resp.json()["weight_version"] == "7"
    resp = http.post(
        "/update_weights_from_disk", json={"model_path": str(ckpts["base"]), "weight_version": 8}
    )
    assert resp.json()["weight_version"] == "8" and resp.json()["token_step"] == 3
    weights = http.get("/status").json()["weights"]
    assert weights["weight_version"] == "8" and weights["token_step"] == 3
    assert weights["weight_update_count"] == v0["weight_update_count"] + 3
    assert weights["last_weight_update_ms"] > 0
    resp = http.post("/update_weight_version", json={"new_version": "relabelled"})
    assert resp.json() == {
        "success": True,
        "new_version": "relabelled",
        "message": "Weight version updated to relabelled",
    }
    assert served_greedy(http, PROMPTS[0])["meta_info"]["weight_version"] == "relabelled"
    info = http.get("/server_info").json()
    assert info["weight_version"] == "relabelled"
    assert http.get("/model_info").json()["weight_version"] == "relabelled"


def _bad(root: Path, base: Path, name: str, mutate) -> Path:
    dst = root / name
    if dst.exists():
        return dst
    shutil.copytree(base, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    mutate(tensors, dst)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def bad_checkpoints(ckpts) -> dict[str, Path]:
    root, base = ckpts["root"], ckpts["base"]
    up = "model.layers.0.mlp.up_proj.weight"
    out = {
        "unknown": _bad(
            root,
            base,
            "unknown",
            lambda t, d: t.__setitem__("model.layers.5.mlp.up_proj.weight", t[up].clone()),
        ),
        "missing": _bad(root, base, "missing", lambda t, d: t.pop(up)),
        "shape": _bad(root, base, "shape", lambda t, d: t.__setitem__(up, t[up][:-2].clone())),
    }
    structure = root / "structure"
    if not structure.exists():
        write_checkpoint(structure, seed=1, num_attention_heads=8)
    out["structure"] = structure
    trunc = root / "truncated"
    if not trunc.exists():
        shutil.copytree(base, trunc)
        data = (trunc / "model.safetensors").read_bytes()
        (trunc / "model.safetensors").write_bytes(data[:-1000])
    out["truncated"] = trunc
    noconf = root / "noconfig"
    if not noconf.exists():
        shutil.copytree(base, noconf)
        (noconf / "config.json").unlink()
    out["no_config"] = noconf
    out["nonexistent"] = root / "does-not-exist"
    return out


@pytest.mark.parametrize(
    "case", ["unknown", "missing", "shape", "structure", "truncated", "no_config", "nonexistent"]
)
def test_refusals_leave_weights_and_version_unchanged(http, ckpts, case):
    restore(http, ckpts["base"], version="good")
    sums = served_sha256(http)
    count = http.get("/get_weight_version").json()["weight_update_count"]
    path = bad_checkpoints(ckpts)[case]
    resp = http.post(
        "/update_weights_from_disk", json={"model_path": str(path), "weight_version": "bad"}
    )
    err = assert_error(resp, 400, "validation_error")
    assert resp.json()["success"] is False and resp.json()["message"] == err["message"]
    assert served_sha256(http) == sums
    v = http.get("/get_weight_version").json()
    assert v["weight_version"] == "good" and v["weight_update_count"] == count
    assert served_greedy(http, PROMPTS[0])["output_ids"] == hf_generate(ckpts["base"], PROMPTS[0])


def test_weights_root_refuses_escapes(http, ckpts, tmp_path):
    outside = write_checkpoint(tmp_path / "outside", seed=4)
    link = ckpts["root"] / "escape-link"
    if not link.exists():
        link.symlink_to(outside)
    sums = served_sha256(http)
    for path in (outside, link, ckpts["root"] / ".." / outside.name):
        resp = http.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert_error(resp, 403, "forbidden")
    assert served_sha256(http) == sums


def test_get_weights_by_name(http, ckpts):
    restore(http, ckpts["base"])
    ref = load_hf(ckpts["base"]).state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "lm_head.weight",
        "model.norm.weight",
    ):
        got = http.get("/get_weights_by_name", params={"name": name, "truncate_size": 3})
        assert got.status_code == 200, got.text
        assert torch.equal(torch.tensor(got.json()["parameter"]), ref[name][:3])
    # A GET with a JSON body (SGLang's tests) and POST; fused parameter names.
    fused = http.request(
        "GET",
        "/get_weights_by_name",
        content=json.dumps({"name": "layers.0.mlp.gate_up_proj.weight", "truncate_size": 200}),
    )
    want = torch.cat(
        [ref["model.layers.0.mlp.gate_proj.weight"], ref["model.layers.0.mlp.up_proj.weight"]]
    )[:200]
    assert torch.equal(torch.tensor(fused.json()["parameter"]), want)
    post = http.post("/get_weights_by_name", json={"name": "model.norm.weight"})
    assert torch.equal(torch.tensor(post.json()["parameter"]), ref["model.norm.weight"])
    assert_error(
        http.get("/get_weights_by_name", params={"name": "model.nope.weight"}), 404, "not_found"
    )
    assert_error(http.get("/get_weights_by_name"), 400, "validation_error")


def test_weights_checker_snapshot_reset_compare(http, ckpts):
    restore(http, ckpts["base"])
    assert http.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
    assert http.post("/weights_checker", json={"action": "reset_tensors"}).status_code == 200
    resp = http.post("/weights_checker", json={"action": "compare"})
    err = assert_error(resp, 400, "validation_error")
    assert "gate_up_proj" in err["message"] and "max_abs_err" in err["message"]
    # Noise under the old label is no checkpoint: nothing is served until it is rewritten.
    ready = http.get("/ready")
    assert ready.status_code == 503 and "weights_inconsistent" in ready.text
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    assert_error(http.post("/generate", json=body), 503, "weights_inconsistent")
    assert http.get("/get_weight_version").json()["weights_torn"] is True
    restore(http, ckpts["base"])
    assert http.get("/ready").status_code == 200
    assert http.post("/generate", json=body).status_code == 200
    assert http.post("/weights_checker", json={"action": "compare"}).status_code == 200
    assert_error(http.post("/weights_checker", json={"action": "explode"}), 400, "validation_error")


def test_disabled_server_answers_403_but_flushes(ckpts):
    with app_server("--model-path", str(ckpts["base"])) as s, s.client() as c:
        for method, route in [
            ("POST", "/pause_generation"),
            ("POST", "/continue_generation"),
            ("GET", "/get_weight_version"),
            ("POST", "/update_weight_version"),
            ("GET", "/get_weights_by_name"),
            ("POST", "/weights_checker"),
            ("POST", "/update_weights_from_disk"),
            ("POST", "/update_weights_from_tensor"),
            ("POST", "/init_weights_update_group"),
            ("POST", "/update_weights_from_distributed"),
            ("POST", "/destroy_weights_update_group"),
        ]:
            assert_error(c.request(method, route, json={}), 403, "route_disabled")
        assert c.get("/flush_cache").json()["success"] is True
        assert c.post("/flush_cache").status_code == 200


def test_disabled_routes_still_need_the_api_key(ckpts):
    with (
        app_server(
            "--allow-weight-update",
            "--model-path",
            str(ckpts["base"]),
            env={"GR_HTTP_API_KEY": "s3cret"},
        ) as s,
        s.client() as c,
    ):
        assert_error(c.get("/get_weight_version"), 401, "unauthorized")
        assert_error(
            c.get("/get_weight_version", headers={"X-GR-API-Key": "nope"}), 403, "forbidden"
        )
        ok = c.get("/get_weight_version", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


# ---- requests in flight -------------------------------------------------------------------

LONG = {
    "input_ids": [i % 120 + 3 for i in range(400)],
    "sampling_params": {"max_new_tokens": 48, "n": 16, "ignore_eos": True},
}


def submit_burst(http, count: int = 12) -> list[str]:
    ids = []
    for _ in range(count):
        resp = http.post("/submit", json=LONG)
        assert resp.status_code == 202, resp.text
        ids.append(resp.json()["request_id"])
    return ids


def results(http, ids) -> list[dict]:
    return [http.get(f"/result/{i}", params={"timeout": 120}).json() for i in ids]


def test_update_with_requests_in_flight_is_409_unless_aborted(http, ckpts):
    restore(http, ckpts["base"], version="base")
    sums = served_sha256(http)
    ids = submit_burst(http)
    resp = http.post(
        "/update_weights_from_disk", json={"model_path": str(ckpts["new"]), "weight_version": "x"}
    )
    err = assert_error(resp, 409, "conflict")
    assert "pause_generation" in err["message"] and "abort_all_requests" in err["message"]
    assert served_sha256(http) == sums
    resp = http.post(
        "/update_weights_from_disk",
        json={
            "model_path": str(ckpts["new"]),
            "weight_version": "forced",
            "abort_all_requests": True,
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["num_aborted_requests"] >= 1
    outs = results(http, ids)
    assert any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    for o in outs:  # every answer came from one version: old, or aborted
        assert len(o["meta_info"]["weight_versions"]) == 1
    assert served_sha256(http) == checkpoint_sha256(ckpts["new"])


def test_pause_abort_with_requests_in_flight(http):
    ids = submit_burst(http)
    resp = http.post("/pause_generation", json={"mode": "abort"}).json()
    assert resp["num_aborted_requests"] >= 1
    assert http.get("/flush_cache").status_code == 200
    outs = results(http, ids)
    assert (
        sum(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
        == resp["num_aborted_requests"]
    )
    http.post("/continue_generation")


def test_pause_retract_flushes_and_continues_on_new_weights(http, ckpts):
    restore(http, ckpts["base"], version="base")
    ids = submit_burst(http, 6)
    assert http.post("/pause_generation", json={"mode": "retract"}).json()["paused"]
    assert http.get("/flush_cache").status_code == 200  # retracted requests do not block it
    restore(http, ckpts["new"], version="new")
    http.post("/continue_generation")
    for o in results(http, ids):
        meta = o["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        # tokens before the retract are base's, the rest new's, after a recompute
        versions = [s["version"] for s in meta["weight_versions"]]
        assert versions in (["new"], ["base", "new"]), meta["weight_versions"]
        if versions == ["base", "new"]:
            assert meta["kv_recomputed_at"] == [meta["weight_versions"][0]["end"]]


def test_pause_in_place_keeps_kv_and_resumes(http, ckpts):
    restore(http, ckpts["base"], version="base")
    ids = submit_burst(http, 6)
    assert http.post("/pause_generation", json={"mode": "in_place"}).json()["paused"]
    status = http.get("/status").json()["scheduler"]
    frozen = status["running"]
    assert frozen >= 1, status
    resp = http.get("/flush_cache")  # requests frozen with their KV: a flush must refuse
    assert resp.status_code == 400 and resp.json()["success"] is False
    resp = http.post(
        "/update_weights_from_disk", json={"model_path": str(ckpts["new"]), "weight_version": "new"}
    )
    assert resp.status_code == 200
    http.post("/continue_generation")
    outs = results(http, ids)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert all(o["meta_info"]["weight_version"] == "new" for o in outs)
    assert any(
        [s["version"] for s in o["meta_info"]["weight_versions"]] == ["base", "new"] for o in outs
    )


def test_concurrent_updates_run_one_at_a_time(http, ckpts):
    codes = []

    def push(path, version):
        with httpx.Client(base_url=str(http.base_url), timeout=60) as c:
            r = c.post(
                "/update_weights_from_disk",
                json={"model_path": str(path), "weight_version": version},
            )
            codes.append(r.status_code)

    before = http.get("/get_weight_version").json()["weight_update_count"]
    threads = [
        threading.Thread(target=push, args=(ckpts["new" if i % 2 else "base"], f"c{i}"))
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 6
    after = http.get("/get_weight_version").json()
    assert after["weight_update_count"] == before + 6
    last = ckpts["new" if int(after["weight_version"][1:]) % 2 else "base"]
    assert served_sha256(http) == checkpoint_sha256(last)
