"""miles' `local_checkpoint_dir` survives a SIGKILL of the server at any point of a pull: the
directory is wholly the old version or wholly the new one (its tensors, read with safetensors,
against the checkpoints' own), and the same pull on a server started afterwards works and
leaves nothing behind; miles' disk reload of the directory then serves the new tensors.

The kill comes from the server itself at a named step (GRCTL_FAULT_LOCAL_KILL_AT,
grctl/testing/faults.py): after the first changed file of the new version is written, once
the version is whole, and after the swap. The base checkpoint has four shards, two of which
the step changes (a file-by-file rename could leave them at different versions)."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import torch

from tests.e2e.test_delta_sync import served, step
from tests.e2e.test_miles_delta import publish_like_miles
from tests.support.checkpoints import dir_tensors, write_checkpoint
from tests.support.serverproc import running_server

MARK = ".grctl-local-version"


def server_args(root, base) -> list[str]:
    return ["--allow-weight-update", "--model-path", str(base), "--weights-root", str(root),
            "--weight-version", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("local-crash")
    base = write_checkpoint(root / "base", seed=5, max_shard_size="100KB")
    assert len(list(base.glob("*.safetensors"))) >= 2
    with running_server(*server_args(root, base)) as srv:
        yield srv, root, base, dir_tensors(base)


def pull(http: httpx.Client, local, pub, version: int) -> httpx.Response:
    body = {"local_checkpoint_dir": str(local), "source_dir": str(pub), "target_version": version}
    return http.post("/pull_weights", json=body)


def version_on_disk(local, old: dict, new: dict) -> int:
    """0 or 1: the version the directory wholly is (marker and every tensor); fails on a mix."""
    marker = int((local / MARK).read_text())
    tensors = dir_tensors(local)
    assert tensors.keys() == old.keys()
    is_old = all(torch.equal(tensors[k], old[k]) for k in old)
    is_new = all(torch.equal(tensors[k], new[k]) for k in new)
    assert (marker, is_old, is_new) in ((0, True, False), (1, False, True)), (marker, is_old)
    return marker


@pytest.mark.parametrize(
    "kill_at,survives",
    [
        ("file_written", 0),
        pytest.param("built", 0, marks=pytest.mark.slow),
        pytest.param("swapped", 1, marks=pytest.mark.slow),
    ],
)
def test_sigkill_mid_pull_leaves_one_version_and_the_same_pull_works(env, kill_at, survives):
    srv, root, base, state = env
    http, pub, local = srv.client(), root / f"pub-{kill_at}", root / f"local-{kill_at}"
    pub.mkdir()
    assert pull(http, local, pub, 0).status_code == 200
    new = step(state, seed=60)
    publish_like_miles(pub, 1, state, new, "xor")

    faults = {"GRCTL_FAULT_LOCAL_KILL_AT": kill_at}
    with running_server(*server_args(root, base), env=faults) as doomed:
        with pytest.raises(httpx.TransportError):
            pull(doomed.client(), local, pub, 1)
        assert doomed.proc.wait(30) == -signal.SIGKILL
    assert version_on_disk(local, state, new) == survives

    # a server that never saw the killed pull: the same pull works, and nothing is left over
    r = pull(http, local, pub, 1)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert version_on_disk(local, state, new) == 1
    beside = sorted(p.name for p in root.iterdir() if p.name.startswith(f".{local.name}."))
    assert beside == [os.readlink(local)]
    assert not [p for p in os.listdir(local) if p.startswith(".") and p != MARK]

    # miles' disk reload of the directory serves the new checkpoint's own tensors
    r = http.post("/update_weights_from_disk",
                  json={"model_path": str(local), "weight_version": "1"})  # fmt: skip
    assert r.status_code == 200 and r.json()["success"], r.text
    for name in ("lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"):
        assert torch.equal(served(srv, name), new[name].float()), name
