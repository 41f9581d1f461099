"""`grctl push --delta BASE` in its own process against real servers: the client makes the delta
from the base checkpoint to the new one and each server applies it (/pull_weights). References:
the new checkpoint's own tensors (its safetensors file), cast to each server's dtype; a refused
delta leaves every served tensor and the label as they were."""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import write_checkpoint
from tests.support.cli import grctl
from tests.support.serverproc import running_server

pytestmark = pytest.mark.timeout(240)
CHANGED = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight",
           "model.norm.weight", "lm_head.weight")  # fmt: skip


def stepped(base, path, seed: int):
    """A copy of checkpoint `base` at `path` with 2% of the elements of CHANGED moved."""
    shutil.copytree(base, path)
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name in CHANGED:
        t = state[name].reshape(-1)
        idx = torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 50)]
        t[idx] += 0.05 * torch.randn(idx.numel(), generator=g)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A float32 and a bfloat16 server on the same base checkpoint."""
    root = tmp_path_factory.mktemp("delta-push")
    base = write_checkpoint(root / "base", seed=4)
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                running_server("--allow-weight-update", "--model-path", str(base), "--dtype", d)
            )
            for d in ("float32", "bfloat16")
        ]
        yield root, base, servers


def label(srv) -> str:
    return srv.client().get("/get_weight_version").json()["weight_version"]


def assert_serves(srv, ckpt, dtype) -> None:
    """Every served tensor equals the checkpoint's, cast to the served dtype."""
    http = srv.client()
    for name, t in load_file(str(ckpt / "model.safetensors")).items():
        r = http.post("/get_weights_by_name", json={"name": name, "truncate_size": 10**7})
        assert r.status_code == 200, r.text
        got = torch.tensor(r.json()["parameter"], dtype=torch.float32)
        assert torch.equal(got, t.to(dtype).float()), name


def urls(servers) -> list[str]:
    return [a for s in servers for a in ("--url", s.url)]


def test_push_delta_serves_the_new_checkpoint_then_refuses_a_wrong_base(env):
    root, base, servers = env
    new = stepped(base, root / "step1", seed=1)
    out = grctl("push", "--checkpoint", str(new), "--delta", str(base), *urls(servers),
                "--weight-version", "7", "--json")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] and doc["result"]["transport"] == "delta"
    assert [s["num_tensors"] for s in doc["result"]["servers"]] == [len(CHANGED)] * 2
    for srv, dtype in zip(servers, (torch.float32, torch.bfloat16), strict=True):
        assert label(srv) == "7"
        assert_serves(srv, new, dtype)
    assert not list(root.glob(".grctl-delta-*"))  # its own delta dir is gone

    # the base named is not what they serve (they serve step1, whose moved elements the
    # delta from base to another step leaves as they are): 409 on a changed tensor's
    # checksum, nothing written, every server resumed
    newer = stepped(base, root / "other", seed=2)
    out = grctl("push", "--checkpoint", str(newer), "--delta", str(base), *urls(servers),
                "--weight-version", "8")  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "does not match its checksum" in out.stdout + out.stderr
    for srv, dtype in zip(servers, (torch.float32, torch.bfloat16), strict=True):
        assert label(srv) == "7"
        assert_serves(srv, new, dtype)
        assert srv.client().post("/generate", json={"input_ids": [1, 2], "sampling_params":
                                 {"max_new_tokens": 2}}).status_code == 200  # fmt: skip

    # a --delta-dir of the user's is kept, each push its next version
    kept = root / "deltas"
    out = grctl("push", "--checkpoint", str(newer), "--delta", str(new), "--delta-dir",
                str(kept), *urls(servers[:1]), "--no-verify")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in kept.iterdir()) == ["weight_v000001"]
    assert label(servers[0]) == "7"  # no --weight-version: the label stays, as a full push's
    assert_serves(servers[0], newer, torch.float32)


def test_delta_usage_errors_exit_2(env):
    root, base, servers = env
    for extra in (("--transport", "tensor"), ("--bucket-mb", "1")):
        out = grctl("push", "--checkpoint", str(base), "--delta", str(base), *extra)
        assert out.returncode == 2, out.stdout + out.stderr
    out = grctl("push", "--checkpoint", str(base), "--delta-dir", str(root))
    assert out.returncode == 2 and "--delta-dir" in out.stderr


def test_a_base_of_other_shapes_is_refused_before_any_pause(env):
    root, base, servers = env
    before = label(servers[0])
    other = write_checkpoint(root / "one-layer", seed=4, num_hidden_layers=1)
    out = grctl("push", "--checkpoint", str(base), "--delta", str(other), *urls(servers[:1]))
    assert out.returncode == 1, out.stdout + out.stderr
    text = " ".join((out.stdout + out.stderr).split())
    assert "differ in tensors or shapes" in text and "refused before any pause" in text
    assert label(servers[0]) == before
