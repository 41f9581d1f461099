"""The commands docs/rl-integration.md tells an RL engineer to run, run as written against the
server it starts there (its flags, the same API key) on a free port."""

from __future__ import annotations

import re
import shlex

from tests.support.cli import grctl
from tests.support.serverproc import REPO_ROOT

DOC = REPO_ROOT / "docs" / "rl-integration.md"


def test_the_check_it_status_line_works_against_the_documented_server(start_server, tmp_path):
    text = DOC.read_text()
    serve = re.search(r"\$ grctl serve (.*?)\n```", text, re.S).group(1).replace("\\\n", " ")
    key = "doc-key-123"
    flags = shlex.split(serve.replace('"$KEY"', key))
    assert "--api-key" in flags  # the documented server wants the key
    flags = [f for f in flags if f not in ("--model-path", "/models/qwen3-gr")]  # built-in model
    flags[flags.index("/shared/weights")] = str(tmp_path)
    flags[flags.index("--host") : flags.index("--host") + 4] = []  # start_server picks the port
    srv = start_server(*flags)
    (status,) = re.findall(r"Check it: `grctl (status [^`]*)`", text)
    args = shlex.split(status.replace('"$KEY"', key).replace("http://host:30000", srv.url))
    out = grctl(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert srv.url in out.stdout and "serving" in out.stdout
