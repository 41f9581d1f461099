"""The threading a grctl process starts with, set before torch loads its OpenMP runtime.

torch's CPU kernels run OpenMP regions whose idle threads spin-wait (GNU OpenMP: 300,000 spins
when OMP_WAIT_POLICY is unset) before they sleep. A server beside a trainer on shared cores
then loses its cores to the other's spinning threads and the other way round: issue 33
measured the server's apply of a 19 MB chunk at 130-600 ms by default against 4-8 ms with
OMP_WAIT_POLICY=passive, and a rollout flood at 1.52-9.56x its FLOP floor against 1.21-1.49x.
OpenMP reads its environment once, when the library loads (at `import torch`), so a process
must set it before that: apply_defaults() is what `grctl`'s entry point runs first.

The rules: a variable the user set wins (any of OMP_WAIT_POLICY, GOMP_SPINCOUNT or
KMP_BLOCKTIME set leaves the wait policy alone; OMP_NUM_THREADS set leaves the thread count
alone); otherwise the wait policy is passive, and the thread count is the CPUs this process may
use (its affinity, capped by a cgroup CPU quota, which OpenMP does not read: a container with
2 CPUs of quota on a 64-core host would otherwise run 64 threads). Nothing here imports torch,
and nothing is changed once torch is loaded (too late to take effect): a trainer that imports
grctl.client keeps its own settings.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
PASSIVE = {"OMP_WAIT_POLICY": "passive"}
CGROUP_ROOT = Path("/sys/fs/cgroup")
MARK = "GRCTL_THREAD_DEFAULTS"  # the names grctl set, for describe() here and in children


def quota_cpus(root: Path = CGROUP_ROOT) -> int | None:
    """The CPUs a cgroup quota allows (v2 cpu.max, v1 cfs quota/period), None without one."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def affinity_cpus() -> int:
    """The CPUs this process may run on (what OpenMP's default thread count follows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def defaults(environ: Mapping[str, str], root: Path = CGROUP_ROOT) -> dict[str, str]:
    """The variables to set: the fast defaults of those the user left unset."""
    chosen: dict[str, str] = {}
    if not any(name in environ for name in WAIT_VARS):
        chosen.update(PASSIVE)
    if "OMP_NUM_THREADS" not in environ:
        quota = quota_cpus(root)
        if quota is not None and quota < affinity_cpus():
            chosen["OMP_NUM_THREADS"] = str(quota)
    return chosen


def apply_defaults() -> dict[str, str]:
    """Set defaults() in this process's environment unless torch is loaded; returns them."""
    if "torch" in sys.modules:  # OpenMP has read its environment already: too late
        return {}
    chosen = defaults(os.environ)
    os.environ.update(chosen)
    if chosen:
        os.environ[MARK] = ",".join(sorted({*os.environ.get(MARK, "").split(","), *chosen} - {""}))
    return chosen


def describe() -> str:
    """One line for the server's log: the wait policy and thread count, and whose they are."""
    names = (*WAIT_VARS, "OMP_NUM_THREADS")
    ours = os.environ.get(MARK, "").split(",")
    parts = []
    for name in names:
        if name in os.environ:
            whose = "grctl's default" if name in ours else "set by the user"
            parts.append(f"{name}={os.environ[name]} ({whose})")
    if not any(name in os.environ for name in WAIT_VARS):
        parts.append("OMP_WAIT_POLICY unset: OpenMP was loaded first; idle threads spin")
    return ", ".join(parts)
