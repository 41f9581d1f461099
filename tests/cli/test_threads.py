"""The threading a `grctl` process starts with (grctl/threads.py): passive OpenMP waits unless
the user chose, read back from OpenMP itself (OMP_DISPLAY_ENV=verbose prints what the runtime
took from its environment at load: GNU OpenMP's spin count is 0 under the passive policy,
300,000 with the variable unset, and 30 billion under `active`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grctl import threads
from tests.support.serverproc import REPO_ROOT, running_server

SPIN = re.compile(r"GOMP_SPINCOUNT = '(\d+)'")


def spin_count(text: str) -> int:
    found = SPIN.findall(text)
    if not found:
        pytest.skip("torch's OpenMP is not GNU OpenMP: no GOMP_SPINCOUNT to read back")
    return int(found[0])


def serve_missing_model(env: dict[str, str]) -> str:
    """`python -m grctl serve` of a missing checkpoint from a clean environment plus env: it
    loads torch (and OpenMP), then exits with its error."""
    full = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO_ROOT), **env}
    missing = str(REPO_ROOT / "no-such-checkpoint")
    done = subprocess.run(
        [sys.executable, "-m", "grctl", "serve", "--device", "cpu", "--model-path", missing],
        capture_output=True,
        text=True,
        env=full,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 1 and "does not exist" in done.stderr, done.stderr
    return done.stdout + done.stderr


def test_the_server_from_a_clean_environment_waits_passively():
    with running_server(clean_env=True, env={"OMP_DISPLAY_ENV": "verbose"}) as srv:
        log = srv.log_text()
    assert spin_count(log) == 0, log[-3000:]
    assert "OMP_WAIT_POLICY=passive (grctl's default)" in log, log[-3000:]


@pytest.mark.parametrize(
    ("env", "spins"),
    [
        ({}, 0),  # grctl's default
        ({"OMP_WAIT_POLICY": "active"}, None),  # the user's choice wins
        ({"GOMP_SPINCOUNT": "12345"}, 12345),  # a spin count alone leaves the policy alone
    ],
)
def test_the_entry_point_sets_the_policy_unless_the_user_did(env, spins):
    got = spin_count(serve_missing_model({"OMP_DISPLAY_ENV": "verbose", **env}))
    if spins is None:
        assert got > 300_000, got  # active: far above the unset default
    else:
        assert got == spins


def test_defaults_keep_what_the_user_set(tmp_path: Path):
    assert threads.defaults({}, tmp_path) == {"OMP_WAIT_POLICY": "passive"}
    for name in threads.WAIT_VARS:
        assert threads.defaults({name: "1"}, tmp_path) == {}


def test_a_cgroup_quota_caps_the_thread_count(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 64)
    (tmp_path / "cpu.max").write_text("250000 100000\n")  # 2.5 CPUs of quota
    assert threads.quota_cpus(tmp_path) == 3
    assert threads.defaults({"OMP_WAIT_POLICY": "x"}, tmp_path) == {"OMP_NUM_THREADS": "3"}
    assert threads.defaults({"OMP_NUM_THREADS": "8", "OMP_WAIT_POLICY": "x"}, tmp_path) == {}
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.defaults({"OMP_WAIT_POLICY": "x"}, tmp_path) == {}
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.quota_cpus(v1) == 4


def test_nothing_changes_once_torch_is_loaded(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "torch" in sys.modules  # this test process has loaded it
    assert threads.apply_defaults() == {}
    assert "OMP_WAIT_POLICY" not in os.environ
