"""No torn weights: a sync stopped part-way never serves, on real servers and real clients.

A server started on checkpoint A (label "A") gets checkpoint B (label "B") in many small buckets,
and the push is stopped: a `grctl push` subprocess hit by SIGINT or SIGKILL at several moments, a
raw trainer process that posts a chunk or two and goes away, a checkpoint that lacks a tensor.
After each, the server either serves one whole checkpoint or refuses: every 200 /generate answer
equals transformers' output on the checkpoint its label names, and a mix of labels answers 503
weights_mixed (409 on /continue_generation) until the rest arrives or an operator relabels.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import load_hf, write_checkpoint
from tests.support.reference import hf_generate
from tests.support.serverproc import REPO_ROOT, assert_error, running_server
from tests.support.weight_helpers import checkpoint_sha256, served_sha256

pytestmark = pytest.mark.timeout(240)

LAYERS = 4  # 47 tensors: ~40 buckets at --bucket-mb 0.001
BUCKET_MB = "0.001"
PROMPTS = [[1, 2, 3, 4, 5], [17, 9, 60]]
MAX_NEW = 4


@pytest.fixture(scope="module")
def ckpts(checkpoint) -> dict:
    out = {}
    for label, seed in (("A", 0), ("B", 1)):
        path = checkpoint(seed=seed, num_hidden_layers=LAYERS)
        hf = load_hf(path)
        out[label] = {"path": path, "greedy": [hf_generate(hf, p, MAX_NEW) for p in PROMPTS]}
    assert out["A"]["greedy"] != out["B"]["greedy"]
    return out


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    args = ("--allow-weight-update", "--model-path", str(ckpts["A"]["path"]))
    return start_server(*args, "--weight-version", "A")


@pytest.fixture
def http(http, ckpts):
    """The module's client, the server back on checkpoint A and serving."""
    restore(http, ckpts["A"]["path"], "A")
    return http


# ---- helpers -------------------------------------------------------------------------------


def restore(http: httpx.Client, path: Path, label: str) -> None:
    body = {"model_path": str(path), "weight_version": label, "abort_all_requests": True}
    assert http.post("/update_weights_from_disk", json=body).status_code == 200
    assert http.post("/continue_generation").status_code == 200


def versions(http: httpx.Client) -> dict:
    return http.get("/get_weight_version").json()


def check_answers(http: httpx.Client, ckpts: dict) -> list[int]:
    """Every prompt: a 200 equals transformers on the checkpoint its label names; anything
    else is a 503 (paused, or weights_mixed). Returns the statuses."""
    statuses = []
    for i, prompt in enumerate(PROMPTS):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW}}
        resp = http.post("/generate", json=body)
        statuses.append(resp.status_code)
        if resp.status_code != 200:
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] in ("paused", "weights_mixed"), resp.text
            continue
        meta = resp.json()["meta_info"]
        assert [s["version"] for s in meta["weight_versions"]] == [meta["weight_version"]], meta
        assert resp.json()["output_ids"] == ckpts[meta["weight_version"]]["greedy"][i]
    return statuses


def assert_mixed(http: httpx.Client) -> dict:
    """Mixed labels: refused everywhere, and nothing resumes it."""
    v = versions(http)
    assert v["weights_mixed"] and set(v["label_counts"]) == {"A", "B"}, v
    err = assert_error(http.post("/continue_generation"), 409, "weights_mixed")
    for label, n in v["label_counts"].items():
        assert f"{n} carry version {label!r}" in err["message"], err
    ready = http.get("/ready")
    assert ready.status_code == 503 and "weights_mixed" in ready.json()["reasons"]
    assert_error(http.post("/generate", json={"input_ids": [1, 2]}), 503, "weights_mixed")
    assert_error(http.post("/submit", json={"input_ids": [1, 2]}), 503, "weights_mixed")
    many = {"requests": [{"input_ids": [1, 2]}]}
    assert_error(http.post("/submit_many", json=many), 503, "weights_mixed")
    status = http.get("/status").json()["weights"]
    assert status["weights_mixed"] and status["label_counts"] == v["label_counts"]
    return v


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "grctl", *args]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200"}


def push_cmd(url: str, path: Path, label: str) -> list[str]:
    return cli("push", "--checkpoint", str(path), "--url", url, "--weight-version", label,
               "--bucket-mb", BUCKET_MB, "--no-verify")  # fmt: skip


def pauses(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    found = re.search(r'route="/pause_generation",status="200"\} ([0-9.]+)', text)
    return float(found.group(1)) if found else 0.0


def push_and_signal(srv, http, ckpts, after: int, sig: int, tmp_path: Path, again_every=None):
    """`grctl push` of B, hit by `sig` once the server has taken `after` buckets (0: once it
    is paused), and by `sig` again every `again_every` seconds until it exits (a user pressing
    Ctrl-C again while the push winds down). Returns (exit code, output, the update count
    before the push)."""
    base = versions(http)["weight_update_count"]
    out_path = tmp_path / "push.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            push_cmd(srv.url, ckpts["B"]["path"], "B"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env(),
            cwd=REPO_ROOT,
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if after == 0 and http.get("/ready").json()["paused"]:
                break
            if after and versions(http)["weight_update_count"] >= base + after:
                break
            time.sleep(0.005)
        assert proc.poll() is None, out_path.read_text()
        proc.send_signal(sig)
        deadline = time.monotonic() + 120
        while again_every and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(again_every)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, out_path.read_text(), base


# ---- a grctl push stopped part-way ---------------------------------------------------------


@pytest.mark.parametrize(
    ("sig", "after"),
    [
        pytest.param(signal.SIGINT, 3, marks=pytest.mark.slow, id="sigint-after-3"),
        pytest.param(signal.SIGINT, 20, id="sigint-after-20"),
        pytest.param(signal.SIGTERM, 10, marks=pytest.mark.slow, id="sigterm-after-10"),
    ],
)
def test_push_interrupted_by_ctrl_c_leaves_a_partial_server_paused(
    srv, http, ckpts, tmp_path, sig, after
):
    code, output, base = push_and_signal(srv, http, ckpts, after, sig, tmp_path)
    assert code == (130 if sig == signal.SIGINT else 143), output
    assert f"push interrupted ({signal.Signals(sig).name})" in output
    found = re.search(r"(paused|resumed), (\d+) of (\d+) buckets applied", output)
    assert found, output
    state, applied, total = found.group(1), int(found.group(2)), int(found.group(3))
    v = versions(http)
    # The client waited for the bucket in flight: its count is the server's.
    assert total > 20 and v["weight_update_count"] - base == applied >= after
    if applied < total:
        assert state == "paused" and "to finish: grctl push" in output, output
        assert_mixed(http)
        labels = re.search(r"labels (.+)", output).group(1)  # most common first
        assert all(f"{k}: {n}" in labels for k, n in v["label_counts"].items()), output
    check_answers(http, ckpts)
    # The printed command finishes the job: one label everywhere, resumed, serving B.
    found = re.search(r"to finish: (.+)", output)
    again = ["grctl", *push_cmd(srv.url, ckpts["B"]["path"], "B")[3:]]
    command = shlex.split(found.group(1)) if found else again
    assert command[:2] == ["grctl", "push"]
    done = subprocess.run(cli(*command[1:]), env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert versions(http)["label_counts"] == {"B": sum(v["label_counts"].values())}
    assert check_answers(http, ckpts) == [200] * len(PROMPTS)


@pytest.mark.slow
def test_push_interrupted_right_after_the_pause(srv, http, ckpts, tmp_path):
    """Ctrl-C before the first bucket lands: nothing new, so the server is resumed (or, if a
    bucket beat the signal, left paused as partial): either way never served mixed."""
    code, output, _ = push_and_signal(srv, http, ckpts, 0, signal.SIGINT, tmp_path)
    assert code == 130, output
    if " 0 of " in output:  # nothing applied: resumed, serving A
        assert "resumed, 0 of" in output and http.get("/ready").status_code == 200, output
        assert versions(http)["label_counts"] == {"A": 47}
        assert check_answers(http, ckpts) == [200] * len(PROMPTS)
    else:
        assert_mixed(http)
        check_answers(http, ckpts)


@pytest.mark.parametrize(
    ("sig", "after"),
    [
        pytest.param(signal.SIGHUP, 0, id="sighup-paused"),
        pytest.param(signal.SIGHUP, 5, marks=pytest.mark.slow, id="sighup-after-5"),
        pytest.param(signal.SIGQUIT, 0, marks=pytest.mark.slow, id="sigquit-paused"),
        pytest.param(signal.SIGQUIT, 5, id="sigquit-after-5"),
    ],
)
def test_sighup_and_sigquit_stop_a_push_as_sigterm_does(srv, http, ckpts, tmp_path, sig, after):
    """A closed terminal (SIGHUP) or Ctrl-\\ (SIGQUIT) during the push: it killed the push at
    once, leaving the server paused with nothing said. Now it stops as SIGTERM does: exit
    128 + the signal, the state left on the server and the command that finishes the job."""
    code, output, base = push_and_signal(srv, http, ckpts, after, sig, tmp_path)
    name = signal.Signals(sig).name
    assert code == 128 + sig, output
    assert f"push interrupted ({name})" in output, output
    found = re.search(r"(paused|resumed), (\d+) of (\d+) buckets applied", output)
    assert found, output
    applied = int(found.group(2))
    assert versions(http)["weight_update_count"] - base == applied
    if applied == 0:  # nothing new: resumed, serving A
        assert found.group(1) == "resumed" and http.get("/ready").status_code == 200, output
        assert check_answers(http, ckpts) == [200] * len(PROMPTS)
    else:
        assert found.group(1) == "paused" and "to finish: grctl push" in output, output
        assert_mixed(http)
        check_answers(http, ckpts)


@pytest.mark.parametrize("after", [pytest.param(0, marks=pytest.mark.slow), 5])
def test_ctrl_c_pressed_again_never_cuts_the_report_short(srv, http, ckpts, tmp_path, after):
    """Ctrl-C, then Ctrl-C every 20 ms while the push winds down: the later ones used to raise
    in the middle of resuming the servers or of the report, killing the push before it said
    what it left (and, once partial, the command that finishes the job)."""
    code, output, base = push_and_signal(srv, http, ckpts, after, signal.SIGINT, tmp_path, 0.02)
    assert code == 130, output
    assert "Traceback" not in output, output
    assert "push interrupted (SIGINT)" in output, output
    found = re.search(r"(paused|resumed), (\d+) of (\d+) buckets applied", output)
    assert found, output
    applied, total = int(found.group(2)), int(found.group(3))
    assert versions(http)["weight_update_count"] - base == applied
    if 0 < applied < total:
        assert found.group(1) == "paused" and "to finish: grctl push" in output, output
        assert_mixed(http)
    elif applied == 0:
        assert found.group(1) == "resumed" and http.get("/ready").status_code == 200, output


@pytest.mark.parametrize("after", [5])
def test_push_killed_leaves_the_server_refusing_until_the_rest_arrives(
    srv, http, ckpts, tmp_path, after
):
    code, output, _ = push_and_signal(srv, http, ckpts, after, signal.SIGKILL, tmp_path)
    assert code == -signal.SIGKILL, output
    assert_mixed(http)
    check_answers(http, ckpts)
    # An operator's `grctl resume` is refused too, naming the mix.
    resumed = subprocess.run(
        cli("resume", "--url", srv.url), env=env(), capture_output=True, text=True
    )
    assert resumed.returncode == 1 and "weights are mixed" in resumed.stdout + resumed.stderr
    check_answers(http, ckpts)
    restore(http, ckpts["B"]["path"], "B")  # the whole of B again (from disk): served
    assert check_answers(http, ckpts) == [200] * len(PROMPTS)


# ---- a raw trainer that sends a chunk or two -----------------------------------------------

CHUNK_CLIENT = r"""
import json, sys
import httpx
from safetensors.torch import load_file
from grctl.weights.wire.encode import encode_bucket
url, path, label, names = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
state = load_file(path + "/model.safetensors")
for chunk in names:
    keep = []
    entry = encode_bucket([(n, state[n]) for n in chunk], keep_alive=keep)
    body = {"serialized_named_tensors": [entry], "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": label}
    r = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=60)
    print(r.status_code, flush=True)
    assert r.status_code == 200, r.text
"""


def post_chunks(url: str, path: Path, label: str, chunks: list[list[str]]) -> None:
    """Chunks posted by a trainer of its own, which exits after the last."""
    proc = subprocess.run(
        [sys.executable, "-c", CHUNK_CLIENT, url, str(path), label, json.dumps(chunks)],
        env=env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_raw_partial_sync_then_continue_is_refused_until_the_rest_arrives(srv, http, ckpts):
    path = ckpts["B"]["path"]
    names = sorted(load_file(path / "model.safetensors"))
    assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    # Two chunks; the second holds only q_proj of layer 1: a part of the fused qkv_proj.
    first = ["model.embed_tokens.weight", "model.norm.weight"]
    post_chunks(srv.url, path, "B", [first, ["model.layers.1.self_attn.q_proj.weight"]])
    v = assert_mixed(http)
    assert v["label_counts"] == {"A": len(names) - 3, "B": 3}
    check_answers(http, ckpts)
    # grctl status names the mix in its compact view, not just the last label
    shown = subprocess.run(cli("status", "--url", srv.url), env=env(), capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "weights mixed" in shown.stdout
    assert f"A: {len(names) - 3}, B: 3" in " ".join(shown.stdout.split())
    # The rest, by another trainer process: one label everywhere again.
    rest = [n for n in names if n not in [*first, "model.layers.1.self_attn.q_proj.weight"]]
    post_chunks(srv.url, path, "B", [rest[: len(rest) // 2], rest[len(rest) // 2 :]])
    assert versions(http)["label_counts"] == {"B": len(names)}
    assert http.post("/continue_generation").status_code == 200
    assert check_answers(http, ckpts) == [200] * len(PROMPTS)


def test_relabel_clears_a_mix_and_session_end_reports_it(srv, http, ckpts):
    path = ckpts["B"]["path"]
    begin = http.post("/begin_weight_update", json={"selector": "all"})
    assert begin.status_code == 200 and begin.json() == {
        "success": True,
        "message": "weight update session opened",
    }
    again = http.post("/begin_weight_update", json={"selector": "all"})
    assert again.status_code == 409 and again.json()["success"] is False
    post_chunks(srv.url, path, "B", [["model.norm.weight"]])
    end = http.post("/end_weight_update", json={})
    assert end.status_code == 409 and end.json()["success"] is False
    assert "1 carry version 'B'" in end.json()["message"]
    assert_error(http.post("/end_weight_update", json={}), 409, "conflict")  # none open now
    # SGLang's weights_checker shape: a failed compare carries top-level success/message.
    assert http.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
    post_chunks(srv.url, ckpts["A"]["path"], "A", [["model.norm.weight"]])
    compare = http.post("/weights_checker", json={"action": "compare"})
    assert compare.status_code == 400 and compare.json()["success"] is False
    assert "norm.weight" in compare.json()["message"] and compare.json()["error"]["status"] == 400
    # The operator declares the mix intended: one label, served again.
    relabel = http.post("/update_weight_version", json={"new_version": "A+norm"})
    assert relabel.status_code == 200
    assert versions(http)["weights_mixed"] is False
    assert http.post("/continue_generation").status_code == 200
    assert http.get("/ready").status_code == 200


def test_allow_partial_weight_update_serves_the_mix(ckpts):
    """The opt-out (--allow-partial-updates, alias --allow-partial-weight-update): labels still
    counted, nothing refused."""
    args = ("--allow-weight-update", "--model-path", str(ckpts["A"]["path"]))
    optout = "--allow-partial-weight-update"
    with running_server(*args, optout, "--weight-version", "A") as s, s.client() as c:
        post_chunks(s.url, ckpts["B"]["path"], "B", [["model.norm.weight"]])
        v = versions(c)
        assert v["weights_mixed"] and v["label_counts"]["B"] == 1
        assert c.get("/ready").status_code == 200
        resp = c.post("/generate", json={"input_ids": PROMPTS[0]})
        assert resp.status_code == 200 and resp.json()["meta_info"]["weight_version"] == "B"


# ---- a checkpoint that does not cover the model --------------------------------------------


def test_partial_checkpoint_is_refused_before_any_pause(srv, http, ckpts, tmp_path):
    partial = write_checkpoint(tmp_path / "partial", seed=1, num_hidden_layers=LAYERS)
    state = load_file(partial / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    before, paused = versions(http), pauses(http)
    done = subprocess.run(
        push_cmd(srv.url, partial, "B"), env=env(), capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "plan failed" in output and "norm.weight" in output, output
    assert pauses(http) == paused  # never paused
    assert versions(http) == before
    assert http.get("/ready").status_code == 200
    assert check_answers(http, ckpts) == [200] * len(PROMPTS)


# ---- a failed copy: torn tensors -----------------------------------------------------------


@pytest.fixture(scope="module")
def faulty(start_server, ckpts, tmp_path_factory):
    """A server whose checkpoint reads fail after 5 tensors under faulty/ (the test hook of
    grctl/testing/faults.py), and that directory."""
    root = tmp_path_factory.mktemp("faulty")
    env = {"GRCTL_FAULT_READ_ERROR_AFTER": "5", "GRCTL_FAULT_READ_ERROR_PATH": str(root)}
    args = ("--allow-weight-update", "--model-path", str(ckpts["A"]["path"]))
    return start_server(*args, "--weight-version", "A", env=env), root


def assert_torn(http: httpx.Client) -> list[str]:
    """Torn tensors: refused exactly as a mix is, and named. Returns their names."""
    v = versions(http)
    torn = v["torn_tensors"]
    assert v["weights_torn"] and torn, v
    assert http.get("/status").json()["weights"]["torn_tensors"] == torn
    err = assert_error(http.post("/continue_generation"), 409, "weights_inconsistent")
    assert torn[0] in err["message"], err
    ready = http.get("/ready")
    assert ready.status_code == 503 and "weights_inconsistent" in ready.json()["reasons"]
    assert_error(http.post("/generate", json={"input_ids": [1, 2]}), 503, "weights_inconsistent")
    assert_error(http.post("/submit", json={"input_ids": [1, 2]}), 503, "weights_inconsistent")
    return torn


def test_a_failed_copy_is_refused_until_each_torn_tensor_is_written_again(faulty, ckpts):
    srv, root = faulty
    bad = root / "B"
    shutil.copytree(ckpts["B"]["path"], bad)
    a = ckpts["A"]["path"]
    with srv.client(timeout=120) as http:
        assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        body = {"model_path": str(bad), "weight_version": "B"}
        assert_error(http.post("/update_weights_from_disk", json=body), 500, "internal_error")
        torn = assert_torn(http)
        assert versions(http)["label_counts"] == {"A": 47}  # labels unchanged: no mix to see
        # slime's empty alignment bucket, labelled: a success that wrote nothing
        post_chunks(srv.url, a, "v2", [[]])
        assert versions(http)["weight_version"] == "v2" and assert_torn(http) == torn
        # an operator's relabel names a mix; it repairs nothing
        assert http.post("/update_weight_version", json={"new_version": "A"}).status_code == 200
        assert assert_torn(http) == torn
        # a tensor the failed copy never touched, written again: the torn ones stay torn
        untouched = next(n for n in sorted(load_file(a / "model.safetensors")) if n not in torn)
        post_chunks(srv.url, a, "A", [[untouched]])
        assert assert_torn(http) == torn
        # exactly the torn tensors, written again with A's values by a trainer of its own
        post_chunks(srv.url, a, "A", [torn])
        v = versions(http)
        assert not v["weights_torn"] and v["torn_tensors"] == [] and v["label_counts"] == {"A": 47}
        assert http.post("/continue_generation").status_code == 200
        assert check_answers(http, ckpts) == [200] * len(PROMPTS)
        assert served_sha256(http) == checkpoint_sha256(a)
