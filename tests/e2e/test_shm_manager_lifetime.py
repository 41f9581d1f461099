"""torch's `torch_shm_manager` daemons never outlive both their sender and the server (issue 32
point 9 asked whether they do; they do not). A CPU `grctl push --transport tensor` starts one
(torch, on its first named shared-memory buffer); the server connects to it to map the
segments and stays connected, so it lives, idle, while the server does (docs/reliability.md
"Known limits"). Once the sender has exited and the server is killed (SIGKILL, or SIGTERM)
the manager's last client is gone and it exits by itself within about 2 s. Managers are told
apart from any other process's by a marker in the environment they inherit from the push."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.serverproc import REPO_ROOT, running_server

pytestmark = pytest.mark.timeout(300)

GONE_WITHIN_S = 10.0


def managers(marker: str) -> list[int]:
    """The torch_shm_manager processes whose environment carries `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().startswith("torch_shm"):
                if f"GRCTL_TEST_MARKER={marker}".encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)]
)
def test_no_shm_manager_outlives_its_sender_and_the_server(checkpoint, sig):
    ckpt, marker = checkpoint(seed=0), uuid.uuid4().hex
    env = {"GRCTL_TEST_MARKER": marker + "-server"}
    with running_server("--allow-weight-update", "--model-path", str(ckpt), env=env) as srv:
        cmd = [sys.executable, "-m", "grctl", "push", "--checkpoint", str(ckpt),
               "--url", srv.url, "--weight-version", "B", "--transport", "tensor",
               "--no-verify"]  # fmt: skip
        push_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GRCTL_TEST_MARKER": marker}
        done = subprocess.run(cmd, env=push_env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert srv.client().get("/get_weight_version").json()["weight_version"] == "B"
        alive = managers(marker)
        assert len(alive) == 1, alive  # the push's, kept by the server's connection
        assert managers(marker + "-server") == []  # the server starts none of its own
        srv.proc.send_signal(sig)
        srv.proc.wait(60)
    deadline = time.monotonic() + GONE_WITHIN_S
    while managers(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = managers(marker)
    for pid in left:  # leave nothing behind, even when failing
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"torch_shm_manager {left} outlived the server by {GONE_WITHIN_S} s"
