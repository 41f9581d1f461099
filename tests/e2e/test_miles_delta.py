"""miles' default disk-delta publication (zstd-compressed payloads, xxh3-128 checksums) applied
by /pull_weights on a real server. The delta is written here as miles' writer lays it out (its
update_weight_from_distributed/delta.py: one `model-NNNNN-of-NNNNN.safetensors` of 1-D uint8
tensors, each a zstd frame of the xor or overwrite payload, the file's metadata mapping each name
to the xxh3-128 hex digest of the tensor's complete new bytes; the HF index with 6-digit
`version`/`base_version`). Reference: the new checkpoint's own tensors."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save
from safetensors.torch import load_file

from tests.e2e.test_delta_sync import CHANGED, label, serve_base, served, step
from tests.support.serverproc import assert_error

zstandard = pytest.importorskip("zstandard")
xxhash = pytest.importorskip("xxhash")

FILE = "model-00000-of-00001.safetensors"


def publish_like_miles(root, version: int, old: dict, new: dict, encoding: str, *, corrupt=False):
    """One miles-layout version dir `weight_v{version:06d}` against `old` (its base)."""
    payloads, sums = {}, {}
    for name in sorted(new):
        a = new[name].contiguous().view(torch.uint8).reshape(-1).numpy()
        b = old[name].contiguous().view(torch.uint8).reshape(-1).numpy()
        if np.array_equal(a, b):
            continue  # unchanged tensors are left out of the version
        if encoding == "xor":
            diff = np.bitwise_xor(a, b)
        else:  # overwrite: u4 count, u4 byte positions, the new byte at each
            pos = np.flatnonzero(a != b).astype("<u4")
            diff = np.concatenate([np.array([pos.size], "<u4").view(np.uint8),
                                   pos.view(np.uint8), a[pos]])  # fmt: skip
        frame = zstandard.ZstdCompressor(level=1).compress(diff.tobytes())
        if corrupt:
            frame = frame[: len(frame) // 2]
        payloads[name] = np.frombuffer(frame, dtype=np.uint8)
        sums[name] = xxhash.xxh3_128(a.tobytes()).hexdigest()
    vdir = root / f"weight_v{version:06d}"
    vdir.mkdir(parents=True)
    (vdir / FILE).write_bytes(save(payloads, metadata=sums))
    meta = {"version": f"{version:06d}", "base_version": f"{version - 1:06d}",
            "delta_encoding": encoding, "compression_format": "zstd",
            "checksum_format": "xxh3-128"}  # fmt: skip
    index = {"metadata": meta, "weight_map": dict.fromkeys(payloads, FILE)}
    (vdir / "model.safetensors.index.json").write_text(json.dumps(index))
    return len(payloads)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from serve_base(tmp_path_factory, "miles-delta", 4)


def test_miles_default_publication_applies(env):
    """Two steps (xor, then overwrite), both zstd + xxh3-128: the served tensors are the second
    step's checkpoint; a truncated zstd frame is a 400 that changes nothing."""
    srv, root, state = env
    src, http = root / "deltas", srv.client()
    one, two = step(state, seed=21), None
    assert publish_like_miles(src, 1, state, one, "xor") == len(CHANGED)
    r = http.post("/pull_weights", json={"source_dir": str(src), "target_version": 1})
    assert r.status_code == 200 and r.json()["success"], r.text
    two = step(one, seed=22)
    publish_like_miles(src, 2, one, two, "overwrite")
    r = http.post("/pull_weights", json={"source_dir": str(src), "target_version": 2})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert label(srv) == "2"
    for name in (*CHANGED, "model.embed_tokens.weight"):
        assert torch.equal(served(srv, name), two[name].float()), name
    assert not torch.equal(two["lm_head.weight"], state["lm_head.weight"])

    publish_like_miles(src, 3, two, step(two, seed=23), "xor", corrupt=True)
    r = http.post("/pull_weights", json={"source_dir": str(src), "target_version": 3})
    assert "not valid zstd" in assert_error(r, 400, "validation_error")["message"]
    assert label(srv) == "2" and torch.equal(served(srv, "lm_head.weight"), two["lm_head.weight"])


def test_miles_local_checkpoint_sequence(env):
    """miles' exact disk-delta calls (miles/backends/megatron_utils/update_weight/
    update_weight_from_distributed/delta.py, the bodies from miles/backends/sglang_utils/
    sglang_engine.py): the pull patches the host-local checkpoint and writes no served weight;
    the disk reload of that directory then serves the new checkpoint's own tensors."""
    srv, root, state = env
    http, pub, local = srv.client(), root / "miles-pub", root / "local-ckpt"
    pub.mkdir()

    def pull(version: int):  # sglang_engine.py:549-553 (SGLangEngine.pull_weights)
        body = {"local_checkpoint_dir": str(local), "source_dir": str(pub),
                "target_version": version}  # fmt: skip
        return http.post("/pull_weights", json=body)

    r = pull(0)  # delta.py:133 (_capture_baseline): materialise the base locally
    assert r.status_code == 200 and r.json()["success"], r.text
    assert torch.equal(load_file(str(local / "model.safetensors"))["lm_head.weight"],
                       state["lm_head.weight"])  # fmt: skip
    before_label, before = label(srv), served(srv, "lm_head.weight")
    new = step(state, seed=31)
    publish_like_miles(pub, 1, state, new, "xor")  # delta.py:228-238 (the index it writes)
    r = pull(1)  # delta.py:250 (_reload_engines)
    assert r.status_code == 200 and r.json()["tensors_loaded"] == len(CHANGED), r.text
    # the pull wrote no served weight: label and tensors as they were
    assert label(srv) == before_label and torch.equal(served(srv, "lm_head.weight"), before)
    assert not list(local.glob(".*tmp*"))  # staged files were renamed into place
    on_disk = load_file(str(local / "model.safetensors"))
    for name in new:
        assert torch.equal(on_disk[name], new[name]), name
    # delta.py:252-262: pause (sglang_engine.py:626), flush (:452), reload, continue (:632)
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    assert http.get("/flush_cache").status_code == 200
    r = http.post("/update_weights_from_disk",
                  json={"model_path": str(local), "weight_version": "1"})  # fmt: skip
    assert r.status_code == 200 and r.json()["success"], r.text
    assert http.post("/continue_generation", json={}).status_code == 200
    assert label(srv) == "1"
    for name in (*CHANGED, "model.embed_tokens.weight"):
        assert torch.equal(served(srv, name), new[name].float()), name

    # refusals that change nothing: a replayed version (the base is now 1), a stale base
    stamp = (local / "model.safetensors").stat().st_mtime_ns
    r = pull(1)
    assert r.status_code == 200 and r.json()["tensors_loaded"] == 0  # already at version 1
    publish_like_miles(pub, 2, state, step(state, seed=32), "overwrite")  # against version 0 bytes
    assert "does not match its checksum" in assert_error(pull(2), 409, "conflict")["message"]
    assert (local / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "body,status",
    [
        ({"local_checkpoint_dir": "/etc/x", "target_version": 0}, 403),
        ({"local_checkpoint_dir": "", "target_version": 0}, 400),
        ({"local_checkpoint_dir": "LOCAL", "target_version": 5}, 409),  # never seeded
        ({"local_checkpoint_dir": "LOCAL", "target_version": 0, "weight_version": "x"}, 400),
    ],
)
def test_local_checkpoint_refusals(env, body, status):
    srv, root, _ = env
    if body["local_checkpoint_dir"] == "LOCAL":
        body["local_checkpoint_dir"] = str(root / "never-seeded")
    body["source_dir"] = str(root / "miles-pub")
    r = srv.client().post("/pull_weights", json=body)
    assert r.status_code == status, r.text
    assert not (root / "never-seeded").exists()


def test_local_checkpoint_catches_up_over_several_versions(env):
    """A pull to N from a directory at N-2 applies both versions in order (each against the
    previous one's bytes); the served weights stay as they were."""
    srv, root, state = env
    http, pub, local = srv.client(), root / "chain-pub", root / "chain-local"
    pub.mkdir()
    body = {"local_checkpoint_dir": str(local), "source_dir": str(pub)}
    assert http.post("/pull_weights", json={**body, "target_version": 0}).status_code == 200
    one = step(state, seed=41)
    two = step(one, seed=42)
    publish_like_miles(pub, 1, state, one, "overwrite")
    publish_like_miles(pub, 2, one, two, "xor")
    before = label(srv), served(srv, "model.norm.weight")
    r = http.post("/pull_weights", json={**body, "target_version": 2})
    assert r.status_code == 200 and r.json()["tensors_loaded"] == 2 * len(CHANGED), r.text
    on_disk = load_file(str(local / "model.safetensors"))
    assert all(torch.equal(on_disk[k], two[k]) for k in two)
    assert label(srv) == before[0]
    assert torch.equal(served(srv, "model.norm.weight"), before[1])


def rle_frame(declared: int | None, blocks: int, byte: int = 7) -> bytes:
    """A zstd frame (RFC 8878) declaring `declared` content bytes in its header (None: no size,
    a 1 MiB window), then `blocks` RLE blocks of 128 KiB: 4 bytes a block on disk, 128 KiB
    each decompressed."""
    if declared is None:  # descriptor 0: a window descriptor (log 10 + 10), no content size
        frame = struct.pack("<IBB", 0xFD2FB528, 0x00, 10 << 3)
    else:  # single segment, an 8-byte content size
        frame = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", declared)
    for i in range(blocks):
        head = (i == blocks - 1) | (1 << 1) | ((128 << 10) << 3)  # last flag, RLE type, size
        frame += struct.pack("<I", head)[:3] + bytes([byte])
    return frame


def peak_rss_reset(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_zstd_frame_declaring_a_huge_size_is_refused_before_decompressing(env, encoding):
    """A 32 KiB delta of RLE blocks that decompresses to 1 GiB (python-zstandard sizes its
    output by the frame's declared content size and ignores max_output_size then): refused
    with a 400 naming the declared size, fast, the server's peak RSS barely moving, nothing
    changed. A frame that declares no size and runs past the bound is refused as well."""
    srv, root, _ = env
    http, src = srv.client(), root / f"rle-{encoding}"
    current = int(label(srv))
    name = "model.embed_tokens.weight"
    sums = {name: "0" * 32}
    for version, frame in (
        (current + 1, rle_frame(1 << 30, 8192)),
        (current + 2, rle_frame(None, 64)),
    ):
        vdir = src / f"weight_v{version:06d}"
        vdir.mkdir(parents=True)
        payload = {name: np.frombuffer(frame, dtype=np.uint8)}
        (vdir / FILE).write_bytes(save(payload, metadata=sums))
        meta = {"version": f"{version:06d}", "base_version": f"{current:06d}",
                "delta_encoding": encoding, "compression_format": "zstd",
                "checksum_format": "xxh3-128"}  # fmt: skip
        index = {"metadata": meta, "weight_map": {name: FILE}}
        (vdir / "model.safetensors.index.json").write_text(json.dumps(index))
    before = served(srv, name)
    peak_rss_reset(srv.proc.pid)
    t0 = time.monotonic()
    r = http.post("/pull_weights", json={"source_dir": str(src), "target_version": current + 1})
    elapsed, grown = time.monotonic() - t0, peak_rss_mib(srv.proc.pid)
    message = assert_error(r, 400, "validation_error")["message"]
    assert f"declaring {1 << 30} bytes" in message, message
    peak_rss_reset(srv.proc.pid)
    base_rss = peak_rss_mib(srv.proc.pid)
    assert grown - base_rss < 64, (grown, base_rss)
    assert elapsed < 5, elapsed
    # no declared size (the frame header's size field left out), 8 MiB of RLE blocks: past the
    # bound of any delta of this tensor (4 + 5 * its bytes), refused
    r = http.post("/pull_weights", json={"source_dir": str(src), "target_version": current + 2})
    assert "not valid zstd (or too large)" in assert_error(r, 400, "validation_error")["message"]
    assert label(srv) == str(current) and torch.equal(served(srv, name), before)
