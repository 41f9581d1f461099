"""grctl's verl plugin (grctl/integrations/verl.py), loaded by `import verl` in every process:
a verl process that never asks for rollout.name=grctl imports nothing of grctl's rollout nor
verl's rollout registries (it loaded ~500 modules more before), one that does finds both
halves by name, and a registration that fails is logged at warning (verl itself logs a
plugin's failure at debug level only). Each runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")

PLUGIN = "grctl.integrations.verl"
COUNT = (
    "import json, sys\nimport verl\n"
    "print(json.dumps([len(sys.modules), sorted(m for m in sys.modules if m.startswith("
    "('grctl', 'verl.workers')))]))\n"
)


def run(code: str, *, plugin: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"}  # the installed entry point off
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    if plugin:  # what the entry point names, loaded the same way
        env["VERL_USE_EXTERNAL_MODULES"] = PLUGIN
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_import_verl_pays_nothing_for_the_plugin_until_grctl_is_asked_for():
    without, _ = json.loads(run(COUNT, plugin=False).stdout)
    code = COUNT + (
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "print(get_rollout_replica_class('grctl').__name__, "
        "get_rollout_class('grctl', 'async').__name__)\n"
    )
    first, named = run(code, plugin=True).stdout.splitlines()
    count, loaded = json.loads(first)
    assert loaded == ["grctl", "grctl.integrations", PLUGIN], loaded
    assert count - without <= 5, (count, without)  # 526 more before
    assert named.split() == ["GrctlReplica", "GrctlServerAdapter"]


def test_a_registration_that_fails_is_a_warning():
    """A verl whose replica module lacks RolloutReplicaRegistry (another version): verl goes
    on, and grctl says at warning that rollout.name=grctl is unknown, and why."""
    code = (
        "import sys, types\n"
        "sys.modules['verl.workers.rollout.replica'] = types.ModuleType("
        "'verl.workers.rollout.replica')\n"
        "import verl\n"
    )
    err = run(code, plugin=True).stderr
    assert "grctl's verl plugin could not register rollout 'grctl'" in err, err[-2000:]
    assert "WARNING" in err and "RolloutReplicaRegistry" in err, err[-2000:]
