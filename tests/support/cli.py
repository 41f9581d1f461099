"""`python -m grctl ...` run as an operator runs it: a real process, the repository importable."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.serverproc import REPO_ROOT


def cli_env(extra: dict | None = None) -> dict:
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "COLUMNS": "250", "PYTHONPATH": path, **(extra or {})}


def grctl(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grctl", *args],
        capture_output=True,
        text=True,
        env=cli_env(env),
        cwd=REPO_ROOT,
        timeout=timeout,
    )
