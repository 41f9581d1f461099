"""The checkpoint's read hooks: empty in production, a test's read fault when it installs one."""

from __future__ import annotations

import pytest

from grctl.testing import faults
from grctl.weights import checkpoint
from grctl.weights.checkpoint import Checkpoint
from tests.support.checkpoints import write_checkpoint


@pytest.fixture
def hooks(monkeypatch):
    monkeypatch.setattr(checkpoint, "read_hooks", [])
    return checkpoint.read_hooks


def test_no_fault_variable_installs_nothing(hooks):
    faults.install_from_env({})
    faults.install_from_env({"GRCTL_FAULT_READ_ERROR_PATH": "/anywhere"})  # alone: no fault
    assert hooks == []


def test_read_error_after_n_tensors_under_a_path(tmp_path, hooks):
    faulty = write_checkpoint(tmp_path / "faulty" / "ckpt", seed=1)
    clean = write_checkpoint(tmp_path / "clean", seed=1)
    env = {
        "GRCTL_FAULT_READ_ERROR_AFTER": "2",
        "GRCTL_FAULT_READ_ERROR_PATH": str(tmp_path / "faulty"),
    }
    faults.install_from_env(env)
    faults.install_from_env(env)  # once per process
    assert len(hooks) == 1
    with Checkpoint(clean) as ckpt:
        assert len([t for _, t in ckpt.iter_tensors()]) > 3
    with Checkpoint(faulty) as ckpt:
        names = [spec.name for spec in ckpt.specs()]
        ckpt.fetch(names[0])
        ckpt.fetch(names[1])
        with pytest.raises(OSError, match="injected read error after 2 tensors"):
            ckpt.fetch(names[2])
