"""The staged shared-memory push on a real server, from a separate client process.

The client reads the checkpoint's tensors straight into its shared-memory buckets; the server
reads each tensor from the bucket's segment with pread into its parameter, through the one sink
(grctl.weights.shm_reads), never through its mapping of the segment. Checked here: the pushed
weights are bit-identical to the checkpoint's own tensors (sha256 of every tensor, against
transformers' load of the checkpoint) and the server read the bytes (its /proc io counters grew
by at least the model's size; a copy through the mapping reads nothing); a segment truncated
while the server reads it fails the update (500), the server stays up and serves nothing from
the torn tensors until the next good update (a read through the mapping would have killed it
with SIGBUS); a client killed while it writes its bucket changes nothing served. No test leaves
a segment in /dev/shm or a descriptor of one open in the server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.serverproc import REPO_ROOT, assert_error
from tests.support.weight_helpers import checkpoint_sha256, served_greedy, served_sha256

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("segment-hold")
    (where / "segment.go").touch()  # reads pass until a test removes it
    return where


@pytest.fixture(scope="module")
def ckpts(checkpoint) -> dict[str, Path]:
    return {"A": checkpoint(seed=31), "B": checkpoint(seed=32)}


@pytest.fixture(scope="module")
def sums(ckpts) -> dict[str, dict[str, str]]:
    out = {label: checkpoint_sha256(path) for label, path in ckpts.items()}
    assert out["A"] != out["B"]
    return out


@pytest.fixture(scope="module")
def srv(start_server, ckpts, hold_dir):
    env = {"GRCTL_FAULT_SEGMENT_HOLD_DIR": str(hold_dir)}
    args = ("--allow-weight-update", "--model-path", str(ckpts["A"]), "--weight-version", "A")
    return start_server(*args, env=env)


def restore(http, path: Path) -> None:
    body = {"model_path": str(path), "weight_version": "A", "abort_all_requests": True}
    assert http.post("/update_weights_from_disk", json=body).status_code == 200
    assert http.post("/continue_generation").status_code == 200


def segments_of(pid: int) -> list[str]:
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"torch_{pid}_"))


def shm_fds(pid: int) -> list[str]:
    """The server's open descriptors into /dev/shm's torch segments."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("/dev/shm/torch_"):
            found.append(target)
    return found


def bytes_read(pid: int) -> int:
    """Bytes the process has read through read-like system calls (pread included)."""
    with open(f"/proc/{pid}/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar:")).split()[1])


def assert_left_nothing(srv, client_pid: int) -> None:
    """The client's segments leave /dev/shm once it is gone (its shm manager unlinks what it
    left, a moment later), and the server holds no descriptor of a segment."""
    deadline = time.monotonic() + 10
    while segments_of(client_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segments_of(client_pid) == []
    assert shm_fds(srv.proc.pid) == []


def push_cmd(srv, path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "grctl", "push", "--checkpoint", str(path), "--url", srv.url,
            "--weight-version", "B", "--transport", "tensor", *extra]  # fmt: skip


def run_push(srv, path: Path, out_path: Path, *extra: str) -> subprocess.Popen:
    """`grctl push` as its own process, its output in a file (torch's shm manager, which it
    starts, would hold a pipe open)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200"}
    with open(out_path, "w") as out:
        return subprocess.Popen(push_cmd(srv, path, *extra), stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)  # fmt: skip


def test_push_is_bit_identical_and_read_not_mapped(srv, http, ckpts, sums, tmp_path):
    restore(http, ckpts["A"])
    model_bytes = sum(f.stat().st_size for f in ckpts["B"].glob("*.safetensors"))
    before = bytes_read(srv.proc.pid)
    # small buckets: several calls, each bucket staged while the one before is read
    proc = run_push(srv, ckpts["B"], tmp_path / "push.out", "--bucket-mb", "0.25")
    assert proc.wait(120) == 0, (tmp_path / "push.out").read_text()  # its own sha256 check too
    assert served_sha256(http) == sums["B"]
    assert http.get("/get_weight_version").json()["label_counts"] == {"B": len(sums["B"])}
    # The server read every byte of the buckets through pread (the safetensors header and the
    # HTTP bodies are all that could add to it); a copy through the mapping reads nothing.
    assert bytes_read(srv.proc.pid) - before >= model_bytes * 0.95
    assert_left_nothing(srv, proc.pid)


@pytest.mark.parametrize("left", [64, 0], ids=["header-left", "nothing-left"])
def test_segment_truncated_while_the_server_reads_it(
    srv, http, ckpts, sums, hold_dir, tmp_path, left
):
    restore(http, ckpts["A"])
    assert http.get("/health").json() == {"ok": True}
    held, go = hold_dir / "segment.held", hold_dir / "segment.go"
    held.unlink(missing_ok=True)
    go.unlink()  # the server's next segment read waits for the test
    proc = run_push(srv, ckpts["B"], tmp_path / "push.out", "--no-verify")
    try:
        deadline = time.monotonic() + 60
        while not held.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the read never came"
            time.sleep(0.01)
        segment = held.read_text()
        # its header (torch's reference count) alone is left, or nothing: torch's own release
        # through the mapping would then be a SIGBUS in the server
        os.truncate(segment, left)
    finally:
        go.touch()
    code = proc.wait(120)
    output = (tmp_path / "push.out").read_text()
    assert code != 0, output
    # Up, and refusing to serve from the tensors the failed copy began.
    assert http.get("/health").json() == {"ok": True}
    assert "weights_inconsistent" in http.get("/ready").json()["reasons"]
    http.post("/continue_generation")
    resp = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {}})
    assert_error(resp, 503, "weights_inconsistent")
    assert_left_nothing(srv, proc.pid)
    # The next good update serves exactly one checkpoint again.
    restore(http, ckpts["A"])
    assert served_sha256(http) == sums["A"]


SLOW_CLIENT = r"""
import sys, time
from grctl.client import WeightSync
from grctl.weights.checkpoint import Checkpoint
url, path = sys.argv[1], sys.argv[2]


class HalfWritten:  # the checkpoint, and a stop when half its tensors are in the bucket
    def __init__(self, path):
        self.ckpt = Checkpoint(path)
        self.config = self.ckpt.config
        self.read = 0

    def specs(self):
        self.num = len(self.ckpt.specs())
        return self.ckpt.specs()

    def fetch(self, name):
        return self.ckpt.fetch(name)

    def read_into(self, name, dst):
        self.read += 1
        if self.read == self.num // 2:
            print("half written", flush=True)
            time.sleep(3600)
        return self.ckpt.read_into(name, dst)


with WeightSync(url, transport="tensor", bucket_mb=512) as sync:
    sync.run(HalfWritten(path), weight_version="B")
"""


def test_client_killed_while_writing_its_bucket(srv, http, ckpts, sums, tmp_path):
    restore(http, ckpts["A"])
    out_path = tmp_path / "client.out"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with open(out_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_CLIENT, srv.url, str(ckpts["B"])],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "half written" not in out_path.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, out_path.read_text()
            time.sleep(0.01)
        assert segments_of(proc.pid), "the bucket being written is not in /dev/shm"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    # The server, paused by the dead client, holds its weights unchanged and whole: once
    # resumed it serves checkpoint A exactly.
    assert http.get("/ready").json()["reasons"] == ["paused"]
    assert served_sha256(http) == sums["A"]
    assert http.get("/get_weight_version").json()["label_counts"] == {"A": len(sums["A"])}
    assert http.post("/continue_generation").status_code == 200
    served_greedy(http, [1, 2, 3])
    assert_left_nothing(srv, proc.pid)
