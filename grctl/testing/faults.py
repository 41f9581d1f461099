"""Test-only fault injection for disk updates: off unless GRCTL_FAULT_READ_ERROR_AFTER is set.

GRCTL_FAULT_READ_ERROR_AFTER=N makes a checkpoint's fetch of its (N+1)-th tensor raise
OSError(EIO), as a failing disk would, once N tensors were read. GRCTL_FAULT_READ_ERROR_PATH,
when set, limits it to checkpoints under that directory. tests/e2e/test_faults.py uses it; never
set either in production.
"""

from __future__ import annotations

import errno
import os
import weakref
from pathlib import Path

_num_fetched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def before_fetch(ckpt) -> None:
    after = os.environ.get("GRCTL_FAULT_READ_ERROR_AFTER")
    if after is None:
        return
    only = os.environ.get("GRCTL_FAULT_READ_ERROR_PATH")
    if only and not ckpt.path.resolve().is_relative_to(Path(only).resolve()):
        return
    n = _num_fetched.get(ckpt, 0)
    _num_fetched[ckpt] = n + 1
    if n >= int(after):
        raise OSError(errno.EIO, f"injected read error after {after} tensors (test hook)")
