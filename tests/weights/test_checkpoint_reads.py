"""A checkpoint file changed while the server validates or reads it is never read as a mix.

The change lands at the worst moments, deterministically: right after `safe_open` parsed the
header (the gap in which tests/e2e/test_faults.py, watching for the file's mapping, rewrote the
shard once and got a 200 serving some rewritten bytes), and between two tensor reads.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file

from grctl.errors import WeightValidationError
from grctl.weights import checkpoint
from grctl.weights.checkpoint import Checkpoint
from tests.support.checkpoints import write_checkpoint


@pytest.fixture
def ckpt_dir(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", seed=5)
    file = path / "model.safetensors"
    past = time.time() - 60  # its last write a clock tick before any change the test makes
    os.utime(file, (past, past))
    return path


def rewrite_in_place(file) -> None:
    """Same length, other bytes: the second half of the file zeroed (the tensors, not the
    header), as a trainer re-saving into the same file would leave it for a moment."""
    size = file.stat().st_size
    with open(file, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(b"\x00" * (size - size // 2))


def test_a_rewrite_right_after_the_header_is_parsed_is_refused_at_validation(ckpt_dir, monkeypatch):
    file = ckpt_dir / "model.safetensors"
    real_safe_open = checkpoint.safe_open

    def open_then_rewrite(path, **kw):
        handle = real_safe_open(path, **kw)
        rewrite_in_place(file)
        return handle

    monkeypatch.setattr(checkpoint, "safe_open", open_then_rewrite)
    with Checkpoint(ckpt_dir) as ckpt, pytest.raises(WeightValidationError, match="changed"):
        ckpt.specs()


def test_a_rewrite_between_reads_fails_the_next_read(ckpt_dir):
    file = ckpt_dir / "model.safetensors"
    want = {name: t.clone() for name, t in load_file(file).items()}  # not a map of the file
    with Checkpoint(ckpt_dir) as ckpt:
        names = [s.name for s in ckpt.specs()]
        assert torch.equal(ckpt.fetch(names[0]), want[names[0]])
        rewrite_in_place(file)
        with pytest.raises(OSError, match="modified after validation"):
            for name in names[1:]:
                got = ckpt.fetch(name)
                assert torch.equal(got, want[name]), name  # before the error: the old bytes
