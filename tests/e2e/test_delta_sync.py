"""Delta syncs over HTTP (/pull_weights) on a real server: the trainer's DeltaPublisher writes the
changed bytes of a step, the server applies them in place. References: the new checkpoint's own
tensors (read back from its safetensors file); every refusal leaves the served tensors and the
label as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file
from safetensors.torch import save_file as save_torch

from grctl.client.delta import DeltaPublisher, pull_weights
from grctl.weights.delta import INDEX, checksum, encode, version_dir
from tests.support.checkpoints import write_checkpoint
from tests.support.serverproc import assert_error, running_server

CHANGED = ("model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight")


def serve_base(tmp_path_factory, name: str, seed: int):
    """A server on a random base checkpoint labelled 0, --weights-root over its folder:
    yields (server, root, the base's tensors)."""
    root = tmp_path_factory.mktemp(name)
    base = write_checkpoint(root / "base", seed=seed)
    state = load_file(str(base / "model.safetensors"))
    with running_server(
        "--allow-weight-update",
        "--model-path",
        str(base),
        "--weights-root",
        str(root),
        "--weight-version",
        "0",
    ) as srv:
        yield srv, root, state


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from serve_base(tmp_path_factory, "delta", 3)


def served(srv, name: str) -> torch.Tensor:
    r = srv.client().post("/get_weights_by_name", json={"name": name, "truncate_size": 10**6})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json()["parameter"], dtype=torch.float32)


def label(srv) -> str:
    return srv.client().get("/get_weight_version").json()["weight_version"]


def step(state: dict, seed: int, frac: float = 0.02) -> dict:
    """A training step: `frac` of the elements of CHANGED move, the rest stay bit-identical."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.items()}
    for name in CHANGED:
        t = new[name].reshape(-1)
        idx = torch.randperm(t.numel(), generator=g)[: max(1, int(frac * t.numel()))]
        t[idx] += 0.01 * torch.randn(idx.numel(), generator=g)
    return new


@pytest.fixture(scope="module")
def synced(env):
    """Three delta steps (xor, overwrite, then sparse); the later tests start from them."""
    srv, root, state = env
    pub = DeltaPublisher(root / "pub")
    pub.snapshot(state, version=0)
    new = state
    for i, enc in enumerate(("xor", "overwrite", "sparse")):
        pub.encoding = enc
        new = step(new, seed=i)
        save_torch(new, str(root / f"step{i + 1}.safetensors"))  # the new checkpoint
        stats = pub.publish(new)
        assert stats.changed_tensors == len(CHANGED)
        assert stats.wire_bytes < stats.total_bytes // 4
        reply = pull_weights(srv.url, root / "pub", stats.version)
        assert reply["success"] and reply["weight_version"] == str(stats.version)
    return pub, load_file(str(root / "step3.safetensors"))


def test_delta_gives_exactly_the_new_checkpoints_tensors(env, synced):
    srv, _, state = env
    _, reference = synced
    assert label(srv) == "3"
    for name in (*CHANGED, "model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert torch.equal(served(srv, name), reference[name]), name
    assert not torch.equal(reference["model.norm.weight"], state["model.norm.weight"])


def test_delta_against_another_version_is_409_and_changes_nothing(env, synced):
    srv, root, state = env
    before = served(srv, "model.norm.weight")
    stale = DeltaPublisher(root / "stale")
    stale.snapshot(state, version=0)  # the server is at version 3
    stale.publish(step(state, seed=9))
    r = srv.client().post(
        "/pull_weights", json={"source_dir": str(root / "stale"), "target_version": 1}
    )
    assert "base is version '000000'" in assert_error(r, 409, "conflict")["message"]
    assert label(srv) == "3" and torch.equal(served(srv, "model.norm.weight"), before)


def test_delta_with_the_right_label_but_other_base_bytes_is_409(env, synced):
    srv, root, state = env
    before = served(srv, "model.norm.weight")
    liar = DeltaPublisher(root / "liar")
    liar.snapshot(state, version=2)  # version 2 (next: base '000003') but the original bytes
    liar.publish(state)  # nothing changed: an empty version 3
    liar.publish(step(state, seed=11))  # version 4 against '000003' that is not the served 3
    r = srv.client().post(
        "/pull_weights", json={"source_dir": str(root / "liar"), "target_version": 4}
    )
    assert "does not match its checksum" in assert_error(r, 409, "conflict")["message"]
    assert label(srv) == "3" and torch.equal(served(srv, "model.norm.weight"), before)


def write_delta(vdir, payloads: dict, sums: dict, encoding="overwrite", base="000003"):
    vdir.mkdir(parents=True)
    save_file(payloads, str(vdir / "d.safetensors"), metadata=sums)
    meta = {"version": "x", "base_version": base, "delta_encoding": encoding,
            "compression_format": "none", "checksum_format": "sha256"}  # fmt: skip
    wm = dict.fromkeys(payloads, "d.safetensors")
    (vdir / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": wm}))


def overwrite(count: int, pos, values) -> np.ndarray:
    head = np.array([count], "<u4").view(np.uint8)
    return np.concatenate(
        [head, np.asarray(pos, "<u4").view(np.uint8), np.asarray(values, np.uint8)]
    )


NORM = "model.norm.weight"  # 64 float32: 256 bytes


@pytest.mark.parametrize(
    "case,payload,encoding",
    [
        ("position out of range", overwrite(1, [256], [7]), "overwrite"),
        ("count larger than the tensor", overwrite(10**6, [], []), "overwrite"),
        ("count and length disagree", overwrite(3, [1, 2], [1, 2]), "overwrite"),
        ("xor of a bf16 tensor (dtype mismatch)", np.zeros(128, np.uint8), "xor"),
        ("huge payload", np.zeros(10**6, np.uint8), "xor"),
        ("not uint8", np.zeros(64, np.float32), "xor"),
        ("sparse with bf16-wide values", overwrite(2, [0, 1], [1, 2, 3, 4]), "sparse"),
    ],
)
def test_malformed_delta_is_400_and_changes_nothing(env, synced, tmp_path, case, payload, encoding):
    srv, root, _ = env
    before, good = served(srv, NORM), served(srv, "lm_head.weight")
    src = root / f"bad-{abs(hash(case))}"
    # a well-formed second tensor first in the file: it must not be written either
    lm = good.clone().reshape(-1)
    lm[0] += 1.0
    lm_bytes = lm.view(torch.uint8).numpy()
    ok = overwrite(4, [0, 1, 2, 3], lm_bytes[:4])
    sums = {"lm_head.weight": checksum("sha256", lm_bytes), NORM: "0" * 64}
    write_delta(version_dir(src, 4), {"lm_head.weight": ok, NORM: payload}, sums, encoding)
    r = srv.client().post("/pull_weights", json={"source_dir": str(src), "target_version": 4})
    assert_error(r, 400, "validation_error")
    assert label(srv) == "3"
    assert torch.equal(served(srv, NORM), before) and torch.equal(
        served(srv, "lm_head.weight"), good
    )


@pytest.mark.parametrize("paused", [True, False])
def test_a_checksum_that_differs_changes_no_tensor(env, synced, paused):
    """lm_head's delta is right, the norm's checksum is wrong. Paused, each CPU tensor is
    patched in place and hashed in one pass: lm_head is written, then both are put back;
    serving, the checks run before any write. Either way nothing changed and nothing is torn."""
    srv, root, _ = env
    http = srv.client()
    if paused:
        assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    before = http.post("/weights_checker", json={"action": "checksum"}).json()["tensors"]
    norm, lm = served(srv, NORM), served(srv, "lm_head.weight")
    new_lm = lm.clone().reshape(-1)
    new_lm[::7] += 1.0
    lm_old, lm_new = lm.reshape(-1).view(torch.uint8).numpy(), new_lm.view(torch.uint8).numpy()
    new_norm = norm.clone()
    new_norm[3] += 1.0
    nb = new_norm.view(torch.uint8).numpy()
    payloads = {
        "lm_head.weight": encode("sparse", lm_new, lm_old, 4),
        NORM: encode("sparse", nb, norm.view(torch.uint8).numpy(), 4),
    }
    sums = {"lm_head.weight": checksum("sha256", lm_new), NORM: checksum("sha256", nb[::-1])}
    src = root / f"wrongsum-{paused}"
    write_delta(version_dir(src, 4), payloads, sums, "sparse")
    r = http.post("/pull_weights", json={"source_dir": str(src), "target_version": 4})
    assert f"tensor {NORM!r} after the delta" in assert_error(r, 409, "conflict")["message"]
    if paused:
        assert http.post("/continue_generation", json={}).status_code == 200
    assert label(srv) == "3"
    assert http.post("/weights_checker", json={"action": "checksum"}).json()["tensors"] == before
    assert http.get("/ready").status_code == 200  # nothing torn: it serves
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert http.post("/generate", json=body).status_code == 200


def test_pull_refuses_paths_outside_the_root_and_missing_versions(env, synced):
    srv, root, _ = env
    http = srv.client()
    assert_error(
        http.post("/pull_weights", json={"source_dir": "/etc", "target_version": 1}),
        403,
        "forbidden",
    )
    r = http.post("/pull_weights", json={"source_dir": str(root / "pub"), "target_version": 99})
    assert_error(r, 404, "not_found")
    assert_error(http.post("/pull_weights", json={"target_version": 1}), 400, "validation_error")
    assert label(srv) == "3"


def test_corrupt_delta_file_is_400(env, synced):
    srv, root, _ = env
    vdir = version_dir(root / "corrupt", 4)
    write_delta(vdir, {NORM: overwrite(0, [], [])}, {NORM: "x"})
    (vdir / "d.safetensors").write_bytes(b"\xff" * 64)
    r = srv.client().post(
        "/pull_weights", json={"source_dir": str(root / "corrupt"), "target_version": 4}
    )
    assert "unreadable" in assert_error(r, 400, "validation_error")["message"]
    assert label(srv) == "3"


@pytest.mark.parametrize("encoding", ["xor", "overwrite", "sparse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encode_then_decode_is_the_new_tensor(encoding, dtype):
    from grctl.weights.delta import decode, encode

    g = torch.Generator().manual_seed(5)
    old = torch.randn(1000, generator=g).to(dtype)
    new = old.clone()
    new[torch.randperm(1000, generator=g)[:25]] += 1.0
    ob, nb = old.view(torch.uint8).numpy(), new.view(torch.uint8).numpy()
    payload = encode(encoding, nb, ob, old.element_size())
    out = decode("t", encoding, payload, ob, old.element_size())
    assert torch.equal(torch.from_numpy(out).view(dtype), new)
    if encoding == "sparse":  # 25 elements: count, positions, values
        assert payload.size == 4 + 25 * (4 + old.element_size())
    assert encode(encoding, ob, ob, old.element_size()) is None
