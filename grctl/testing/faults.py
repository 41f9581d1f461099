"""Test-only fault injection for weight updates, installed into the checkpoint's read hooks and
the updater's sync hooks.

GRCTL_FAULT_READ_ERROR_AFTER=N makes a checkpoint's fetch of its (N+1)-th tensor raise
OSError(EIO), as a failing disk would, once N tensors were read. GRCTL_FAULT_READ_ERROR_PATH,
when set, limits it to checkpoints under that directory. GRCTL_FAULT_SYNC_ERROR_AT=STEP makes a
sync that carries a catalog raise RuntimeError at that step (updater.sync_hooks: catalog_built,
after the catalog is built and before the weights are validated; weights_written, after the
weights are written and before the catalog is installed); GRCTL_FAULT_SYNC_ERROR_PATH, when
set, limits it to catalogs under that directory. GRCTL_FAULT_STAGE_HOLD=BOUNDARY (a multi-stage
boundary of engine/stages.py: before_reasoning, after_reasoning, after_items) with
GRCTL_FAULT_STAGE_HOLD_DIR=DIR holds every multi-stage group there: it writes DIR/BOUNDARY.held
and waits (up to 60 s) for DIR/BOUNDARY.go, so a test can write weights exactly at that
boundary; once the .go file exists, later groups pass. GRCTL_FAULT_LOCAL_KILL_AT=STEP SIGKILLs
the server at that step of a local checkpoint pull (weights/local_checkpoint.py hooks:
file_written, after a changed file of the new version is written; built, once the version is
whole and before it is swapped in; swapped, after the swap and before the old version is
removed), as a crash or an OOM kill would. GRCTL_FAULT_SEGMENT_HOLD_DIR=DIR holds the server's
read of a pushed shared-memory tensor once GRCTL_FAULT_SEGMENT_HOLD_AFTER (default 0) such
reads were made: it writes DIR/segment.held (the segment's path) and waits (up to 60 s) for
DIR/segment.go, so a test can truncate the segment mid-copy; later reads pass. The server calls
`install_from_env` at start; with no variable set nothing is installed. tests/e2e/test_faults.py,
tests/e2e/test_catalog_sync.py, tests/e2e/test_local_checkpoint_crash.py and
tests/e2e/test_shm_push.py use them; never set any in production.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

from grctl.engine import stages
from grctl.weights import checkpoint, local_checkpoint, shm_reads, updater

_num_fetched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install_from_env(env: Mapping[str, str] = os.environ) -> None:
    """Install the faults `env` asks for into the checkpoint's read hooks and the updater's
    sync hooks (once per process)."""
    step = env.get("GRCTL_FAULT_SYNC_ERROR_AT")
    if step and not any(getattr(h, "func", None) is _sync_error_at for h in updater.sync_hooks):
        where = env.get("GRCTL_FAULT_SYNC_ERROR_PATH")
        updater.sync_hooks.append(functools.partial(_sync_error_at, step, where))
    hold, hold_dir = env.get("GRCTL_FAULT_STAGE_HOLD"), env.get("GRCTL_FAULT_STAGE_HOLD_DIR")
    if hold and hold_dir and not any(getattr(h, "func", None) is _stage_hold for h in stages.hooks):
        stages.hooks.append(functools.partial(_stage_hold, hold, Path(hold_dir)))
    kill = env.get("GRCTL_FAULT_LOCAL_KILL_AT")
    if kill and not any(getattr(h, "func", None) is _kill_at for h in local_checkpoint.hooks):
        local_checkpoint.hooks.append(functools.partial(_kill_at, kill))
    seg_dir = env.get("GRCTL_FAULT_SEGMENT_HOLD_DIR")
    if seg_dir and not any(getattr(h, "func", None) is _segment_hold for h in shm_reads.read_hooks):
        seg_after = int(env.get("GRCTL_FAULT_SEGMENT_HOLD_AFTER", "0"))
        shm_reads.read_hooks.append(functools.partial(_segment_hold, Path(seg_dir), [seg_after]))
    after = env.get("GRCTL_FAULT_READ_ERROR_AFTER")
    installed = [getattr(hook, "func", None) for hook in checkpoint.read_hooks]
    if after is None or _read_error_after in installed:
        return
    only = env.get("GRCTL_FAULT_READ_ERROR_PATH")
    checkpoint.read_hooks.append(functools.partial(_read_error_after, int(after), only))


def _read_error_after(after: int, only: str | None, ckpt: checkpoint.Checkpoint) -> None:
    if only and not ckpt.path.resolve().is_relative_to(Path(only).resolve()):
        return
    n = _num_fetched.get(ckpt, 0)
    _num_fetched[ckpt] = n + 1
    if n >= after:
        raise OSError(errno.EIO, f"injected read error after {after} tensors (test hook)")


def _sync_error_at(at: str, only: str | None, step: str, catalog_path: str) -> None:
    if only and not Path(catalog_path).resolve().is_relative_to(Path(only).resolve()):
        return
    if step == at:
        raise RuntimeError(f"injected sync error at {step} (test hook)")


def _kill_at(at: str, step: str) -> None:
    if step == at:
        os.kill(os.getpid(), signal.SIGKILL)


def _stage_hold(at: str, where: Path, boundary: str, request_id: str) -> None:
    if boundary != at:
        return
    go = where / f"{at}.go"
    if go.exists():
        return
    (where / f"{at}.held").write_text(request_id)
    deadline = time.monotonic() + 60.0
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _segment_hold(where: Path, left: list[int], path: str, name: str) -> None:
    go = where / "segment.go"
    if go.exists():
        return
    left[0] -= 1
    if left[0] >= 0:
        return
    (where / "segment.held").write_text(path)
    deadline = time.monotonic() + 60.0
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
