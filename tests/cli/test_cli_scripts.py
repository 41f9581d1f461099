"""The client CLI as a CI smoke script uses it: real `python -m grctl` processes against real
servers; --json gives one JSON document on stdout, exit codes 0 ok / 1 failed / 2 usage /
130 interrupted; the human output fits 80 columns and says what happened."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import httpx
import pytest

from grctl import __version__
from tests.support.cli import cli_env
from tests.support.cli import grctl as run_grctl
from tests.support.reference import hf_generate
from tests.support.serverproc import REPO_ROOT, start_servers

pytestmark = pytest.mark.timeout(240)
KEY = "sekret"
STATUS_SECTIONS = {"weights", "scheduler", "requests", "prefill_cache", "engine"}


def grctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_grctl(*args, env={"COLUMNS": "80", **(env or {})})


def one_json(out: subprocess.CompletedProcess) -> dict:
    return json.loads(out.stdout)  # fails unless stdout is exactly one JSON document


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    """A guarded server that takes updates, and one whose weight routes and prefix cache are
    off (SGLang's --disable-radix-cache)."""
    with ExitStack() as stack:
        ckpt = str(tiny_checkpoint)
        (guarded,) = start_servers(
            stack, 1, "--model-path", ckpt, "--allow-weight-update", "--api-key", KEY
        )
        (plain,) = start_servers(stack, 1, "--model-path", ckpt, "--disable-radix-cache")
        yield guarded, plain


def test_version_and_json_usage_error():
    out = grctl("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"grctl {__version__}"
    out = grctl("pause", "--mode", "sideways", "--json")
    assert out.returncode == 2
    doc = one_json(out)
    assert doc["command"] == "pause" and doc["ok"] is False
    assert doc["error"]["code"] == "usage_error"
    assert "sideways" in doc["error"]["message"]


def test_status_json_and_compact_view(servers):
    guarded, plain = servers
    # no scheme: http:// is added; the key comes from the new GR_API_KEY name
    hostport = guarded.url.removeprefix("http://")
    out = grctl("status", "--json", "--url", hostport, "--url", plain.url,
                env={"GR_API_KEY": KEY})  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = one_json(out)
    assert doc["command"] == "status" and doc["ok"] is True
    assert [s["url"] for s in doc["servers"]] == [guarded.url, plain.url]
    for s in doc["servers"]:
        assert s["ok"] and STATUS_SECTIONS <= set(s["reply"])
        live = httpx.get(s["url"] + "/status", headers={"X-GR-API-Key": KEY}).json()
        assert s["reply"]["weights"] == live["weights"]
        assert s["reply"]["engine"]["device"] == live["engine"]["device"] == "cpu"

    out = grctl("status", "--url", plain.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert out.stdout.count("version") == 1  # the weight version, once (not in two sections)
    assert f"{plain.url}: serving" in out.stdout and "prefill cache  off" in out.stdout


@pytest.mark.slow
def test_wrong_or_missing_key_is_a_json_error(servers):
    guarded, _ = servers
    out = grctl("pause", "--json", "--url", guarded.url, "--api-key", "wrong")
    assert out.returncode == 1
    doc = one_json(out)
    assert doc["ok"] is False and doc["servers"][0]["error"]["code"] == "forbidden"
    assert "GR_API_KEY" in doc["servers"][0]["error"]["message"]
    assert out.stderr.count("error:") == 1 and "Traceback" not in out.stderr
    assert httpx.get(guarded.url + "/ready").json()["paused"] is False  # nothing changed

    out = grctl("resume", "--json", "--url", guarded.url)
    assert out.returncode == 1
    assert one_json(out)["servers"][0]["error"]["code"] == "unauthorized"
    assert "--api-key or GR_API_KEY" in out.stderr

    for env in ({"GR_API_KEY": KEY}, {"GR_HTTP_API_KEY": KEY}):  # the new name and the old one
        out = grctl("pause", "--json", "--url", guarded.url, env=env)
        assert out.returncode == 0, out.stderr
        assert one_json(out)["servers"][0]["reply"]["paused"] is True
        assert grctl("resume", "--url", guarded.url, env=env).returncode == 0


@pytest.mark.slow
def test_push_summary_json_and_failures(servers, tiny_checkpoint):
    guarded, plain = servers
    key = ("--api-key", KEY)
    out = grctl("push", "--checkpoint", str(tiny_checkpoint), "--url", guarded.url, *key,
                "--bucket-mb", "0.05", "--weight-version", "j1")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert max(map(len, out.stdout.splitlines())) <= 80, out.stdout
    assert "1 of 1 server(s) ok" in out.stdout and "MB/s)" in out.stdout  # a tiny push
    assert "default -> j1" in out.stdout and "verified" in out.stdout
    assert len(out.stdout.splitlines()) <= 3  # the headline (wrapped at 80), one server row

    out = grctl("push", "--checkpoint", str(tiny_checkpoint), "--url", guarded.url, *key,
                "--weight-version", "j1", "--verbose")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert max(map(len, out.stdout.splitlines())) <= 80, out.stdout
    assert "every tensor's sha256 matches" in out.stdout and "verify 0." in out.stdout

    out = grctl("push", "--checkpoint", str(tiny_checkpoint), "--url", guarded.url, *key,
                "--transport", "disk", "--weight-version", "j2", "--verbose")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "0 B" not in out.stdout and "B/s" not in out.stdout
    assert "tensors, read by the server" in out.stdout
    assert "the servers read" in out.stdout and "tensors from" in out.stdout

    out = grctl("push", "--checkpoint", str(tiny_checkpoint), "--url", guarded.url, *key,
                "--json", "--weight-version", "j3", "--transport", "tensor")  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = one_json(out)
    assert doc["command"] == "push" and doc["ok"] is True
    (srv,) = doc["result"]["servers"]
    assert srv["ok"] and srv["old_version"] == "j2" and srv["weight_version"] == "j3"
    assert srv["verified"] is True and srv["num_bytes"] == doc["result"]["num_bytes"] > 0

    # One server never reached, one whose weight routes are off: each says what happened.
    dead = "http://127.0.0.1:9"
    out = grctl("push", "--checkpoint", str(tiny_checkpoint), "--url", dead, "--url", plain.url,
                "--json")  # fmt: skip
    assert out.returncode == 1
    doc = one_json(out)
    assert doc["ok"] is False and doc["error"]["code"] == "sync_failed"
    states = {s["url"]: (s["failed_stage"], s["state"]) for s in doc["result"]["servers"]}
    assert states[dead] == ("connect", "never reached, so nothing changed there")
    assert states[plain.url] == ("pause", "not paused, nothing changed (version default)")
    assert "NOT resumed" not in out.stderr and "--allow-weight-update" in out.stderr


def test_disk_push_refuses_tensor_only_flags(tiny_checkpoint):
    for flag in (["--chunked"], ["--no-chunked"], ["--bucket-mb", "8"]):
        out = grctl("push", "--checkpoint", str(tiny_checkpoint), "--transport", "disk", *flag,
                    "--json")  # fmt: skip
        assert out.returncode == 2, flag
        assert "applies to --transport tensor only" in one_json(out)["error"]["message"], flag


@pytest.mark.slow
def test_flush_hint_when_paused_in_place_and_ctrl_c_exits_130():
    """A request frozen by an in_place pause keeps its KV: the flush hint says to resume or to
    pause with abort/retract (not 'pause first'); Ctrl-C during the retries exits 130 with a
    JSON error document."""
    from tests.support.serverproc import running_server

    with running_server("--allow-weight-update") as srv, srv.client() as http:
        body = {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 64, "n": 16}}
        replies: list = []
        gen = threading.Thread(target=lambda: replies.append(http.post("/generate", json=body)))
        gen.start()
        deadline = time.monotonic() + 30
        while http.get("/status").json()["scheduler"]["num_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        # over HTTP, at once: a CLI process would start after the request had finished
        assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert http.get("/status").json()["scheduler"]["num_running"] == 1, "finished too soon"

        out = grctl("flush", "--url", srv.url, "--retries", "2", "--interval", "0.1")
        assert out.returncode == 1
        assert "paused in_place" in out.stderr and "abort or retract" in out.stderr
        assert "pause generation first" not in out.stderr

        cmd = [sys.executable, "-m", "grctl", "flush", "--url", srv.url, "--json",
               "--retries", "1000", "--interval", "0.2"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=cli_env(), cwd=REPO_ROOT)  # fmt: skip
        time.sleep(4)  # past the import, inside the retry loop
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130, stdout + stderr
        assert json.loads(stdout)["error"]["code"] == "interrupted"

        assert grctl("resume", "--url", srv.url).returncode == 0
        gen.join(60)
        assert replies and replies[0].status_code == 200


SHM_FULL = """
import os, shutil
from grctl.client.staging import ShmFull, shared_buffer
print(os.getpid())
try:
    shared_buffer(shutil.disk_usage("/dev/shm").total + (1 << 30))
except ShmFull as exc:
    print(exc)
"""


def test_shm_full_names_the_fixes():
    """A bucket larger than /dev/shm (Docker's default is 64 MiB) fails saying what to do.
    Larger than the whole tmpfs, so the kernel refuses it at once, without filling it; the
    segment name torch made is gone once the pushing process exits."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    out = subprocess.run([sys.executable, "-c", SHM_FULL], capture_output=True, text=True,
                         env=cli_env(), cwd=REPO_ROOT, timeout=120)  # fmt: skip
    pid, _, text = out.stdout.partition("\n")
    assert out.returncode == 0 and "has no room" in text, out.stdout + out.stderr
    assert "--transport disk" in text and "--bucket-mb" in text and "--shm-size" in text
    deadline = time.monotonic() + 20  # torch_shm_manager unlinks it after the process exits
    while [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{pid}_")]:
        assert time.monotonic() < deadline, "a shared-memory segment outlived its process"
        time.sleep(0.2)


@pytest.mark.slow
def test_model_export_then_generate_equals_transformers(tmp_path):
    """README's offline commands: `grctl model export DIR` writes an HF checkpoint that
    transformers loads, and `grctl generate` on it (and on the built-in model it came from)
    prints transformers' greedy tokens."""
    out = grctl("model", "export", str(tmp_path / "builtin"))
    assert out.returncode == 0, out.stderr
    assert {p.name for p in (tmp_path / "builtin").iterdir()} >= {"config.json",
                                                                 "model.safetensors"}  # fmt: skip
    want = hf_generate(tmp_path / "builtin", [1, 300, 600], max_new_tokens=3)
    for where in (["--model-path", str(tmp_path / "builtin")], []):
        out = grctl("generate", "1,300,600", "--max-new-tokens", "3", "--device", "cpu", *where)
        assert out.returncode == 0, out.stderr
        rank, ids, score, reason = out.stdout.strip().split("\t")
        assert rank == "0" and json.loads(ids) == want and reason == "length", out.stdout
        assert score.startswith("score=-")
    out = grctl("generate", "1,x,3")
    assert out.returncode == 2 and "integers" in out.stderr
