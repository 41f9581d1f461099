"""The client commands start without torch or transformers: `grctl --version`, `--help` and the
commands that only call servers import neither (python -X importtime lists every module a real
`python -m grctl` process imported); push and verify, which read checkpoint tensors, may."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.cli import cli_env
from tests.support.serverproc import REPO_ROOT

pytestmark = pytest.mark.timeout(180)
HEAVY = ("torch", "transformers")


def imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """The top-level packages `python -X importtime -m grctl ARGS` imported, and its result."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "grctl", *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO_ROOT,
        timeout=120,
    )
    names = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "grctl" in names, done.stderr[-2000:]  # importtime did list the imports
    return names, done


@pytest.fixture(scope="module")
def srv(start_server, tiny_checkpoint):
    return start_server("--model-path", str(tiny_checkpoint))


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["serve", "--help"]])
def test_version_and_help_import_no_torch(args):
    names, done = imported(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


@pytest.mark.parametrize("command", [["status"], ["catalog", "status"], ["flush"]])
def test_client_commands_import_no_torch(srv, command):
    names, done = imported(*command, "--url", srv.url, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["servers"][0]["ok"]  # it did call the server
    assert not names & set(HEAVY), sorted(names & set(HEAVY))
