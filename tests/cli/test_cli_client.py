"""The client commands as an operator runs them: `python -m grctl ...` in real processes against
real servers. Exit codes: 0 success, 1 failed sync or verification, 2 usage."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import pytest
from typer.testing import CliRunner

from grctl.cli import app
from grctl.client import GRClient
from tests.support.cli import cli_env, grctl
from tests.support.reference import hf_generate
from tests.support.serverproc import REPO_ROOT, start_servers
from tests.support.weight_helpers import served_by_client

pytestmark = pytest.mark.timeout(180)
PROMPT = [1, 5, 9, 42, 7]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def ckpts(checkpoint):
    return checkpoint(seed=0), checkpoint(seed=1)


@pytest.fixture(scope="module")
def fleet(ckpts):
    with ExitStack() as stack:
        yield start_servers(stack, 2, "--model-path", str(ckpts[0]), "--allow-weight-update")


def urls(fleet) -> list[str]:
    return [arg for s in fleet for arg in ("--url", s.url)]


def test_usage_errors_exit_2():
    runner = CliRunner()
    assert runner.invoke(app, ["push"]).exit_code == 2  # --checkpoint is required
    assert runner.invoke(app, ["push", "--checkpoint", "x", "--transport", "ftp"]).exit_code == 2
    assert runner.invoke(app, ["pause", "--mode", "sideways"]).exit_code == 2
    assert runner.invoke(app, ["flush", "--retries", "0"]).exit_code == 2


def test_push_chunked_then_disk(fleet, ckpts):
    out = grctl(
        "push",
        "--checkpoint",
        str(ckpts[1]),
        *urls(fleet),
        "--bucket-mb",
        "0.01",
        "--weight-version",
        "5",
    )
    assert out.returncode == 0, out.stderr
    assert "version 5" in out.stdout and out.stdout.count("ok") >= 2 and "B/s" in out.stdout
    want = hf_generate(ckpts[1], PROMPT, NEW_TOKENS)
    assert all(served_by_client(s.url, PROMPT, NEW_TOKENS) == (want, "5") for s in fleet)

    gr_url = " ".join(s.url for s in fleet)  # GR_URL holds the fleet, space-separated
    out = grctl(
        "push",
        "--checkpoint",
        str(ckpts[0]),
        "--transport",
        "disk",
        "--weight-version",
        "6",
        env={"GR_URL": gr_url},
    )
    assert out.returncode == 0, out.stderr
    want = hf_generate(ckpts[0], PROMPT, NEW_TOKENS)
    assert all(served_by_client(s.url, PROMPT, NEW_TOKENS) == (want, "6") for s in fleet)


def test_verify_passes_and_fails(fleet, ckpts):
    out = grctl("verify", "--checkpoint", str(ckpts[0]), *urls(fleet))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tensors match") == 2
    out = grctl("verify", "--checkpoint", str(ckpts[1]), *urls(fleet))
    assert out.returncode == 1
    assert "MISMATCH" in out.stdout and "model.layers.0.self_attn.q_proj.weight" in out.stdout
    assert out.stderr.count("error:") == 1 and "verification failed on 2 server(s)" in out.stderr
    assert "Traceback" not in out.stderr


def test_pause_flush_status_resume(fleet):
    url = fleet[0].url
    out = grctl("pause", "--url", url, "--mode", "retract")
    assert out.returncode == 0, out.stderr
    with GRClient(url) as gr:
        assert gr.ready().reasons == ["paused"]
        assert grctl("flush", "--url", url, "--retries", "3", "--interval", "0.1").returncode == 0
        out = grctl("status", "--url", url)
        assert out.returncode == 0 and "paused (retract)" in out.stdout, out.stdout
        assert f"version {gr.status().weights.weight_version}," in out.stdout
        assert grctl("resume", "--url", url).returncode == 0
        assert gr.ready().ready


def test_unreachable_server_is_one_red_line():
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    out = grctl("status", "--url", dead, "--timeout", "2")
    assert out.returncode == 1 and "cannot reach" in out.stderr and "Traceback" not in out.stderr
    out = grctl("status", "--url", dead, "--timeout", "2", env={"GRCTL_DEBUG": "1"})
    assert out.returncode == 1 and "Traceback" in out.stderr


def test_server_killed_mid_push(fleet, ckpts):
    with ExitStack() as stack:
        (doomed,) = start_servers(stack, 1, "--model-path", str(ckpts[0]), "--allow-weight-update")
        args = ["--checkpoint", str(ckpts[1]), "--bucket-mb", "0.002", "--weight-version", "k"]
        cmd = [sys.executable, "-m", "grctl", "push", *args, *urls([fleet[0], doomed, fleet[1]])]
        push = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=cli_env(),
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill it once it has taken a first chunk
            count = httpx.get(doomed.url + "/get_weight_version").json()["weight_update_count"]
            if count >= 1:
                break
            time.sleep(0.005)
        doomed.proc.kill()
        stdout, stderr = push.communicate(timeout=120)
    assert push.returncode == 1, stdout + stderr
    assert doomed.url in stderr and "failed on 1 of 3" in stderr, stderr
    want = hf_generate(ckpts[1], PROMPT, NEW_TOKENS)
    for srv in (fleet[0], fleet[1]):
        with GRClient(srv.url) as gr:
            assert gr.ready().ready
        assert served_by_client(srv.url, PROMPT, NEW_TOKENS) == (want, "k")


def test_demo_runs_end_to_end():
    t0 = time.monotonic()
    out = grctl("demo", timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "perturbed" in out.stdout and "restored" in out.stdout
    assert "item-" in out.stdout and "not an item" in out.stdout  # with and without the catalog
    assert time.monotonic() - t0 < 60
