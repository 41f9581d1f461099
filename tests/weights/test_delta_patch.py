"""delta_patch: the in-place apply gives the bytes delta.decode builds, and its streamed
checksum is the checksum of those bytes (the references: delta.decode, and each format's own
library over the whole new bytes)."""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import pytest
import torch

from grctl.errors import Conflict
from grctl.weights import delta, delta_patch


def reference_checksum(algorithm: str, data: np.ndarray) -> str:
    import xxhash

    return {
        "sha256": lambda b: hashlib.sha256(b).hexdigest(),
        "adler32": lambda b: f"{zlib.adler32(b):08x}",
        "xxh3-128": lambda b: xxhash.xxh3_128(b).hexdigest(),
    }[algorithm](data.tobytes())


def pair(n: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = old.copy()
    units = new.view(f"<u{width}") if width in (1, 2, 4, 8) else new.reshape(-1, width)
    idx = rng.choice(n, n // 50 + 1, replace=False)
    fresh = rng.integers(0, 256, idx.size * width, dtype=np.uint8)
    units[idx] = fresh.view(units.dtype).reshape(units[idx].shape)
    return old, new


@pytest.mark.parametrize("chunk", [7, 4096, 1 << 20])
@pytest.mark.parametrize(
    ("encoding", "width"), [("sparse", 2), ("sparse", 4), ("overwrite", 1), ("xor", 1)]
)
@pytest.mark.parametrize("algorithm", ["sha256", "adler32", "xxh3-128"])
def test_in_place_equals_decode(monkeypatch, chunk, encoding, width, algorithm):
    monkeypatch.setattr(delta_patch, "CHUNK", chunk)
    old, new = pair(30_011, width)
    payload = delta.encode(encoding, new, old, width)
    want = delta.decode("t", encoding, payload, old, width)
    assert np.array_equal(want, new)
    patch = delta_patch.parse("t", encoding, payload, old.size, width)
    assert delta_patch.checksum_after(algorithm, old, patch) == reference_checksum(algorithm, new)
    assert delta.checksum(algorithm, new) == reference_checksum(algorithm, new)
    live = torch.from_numpy(old.copy())
    delta_patch.write(live, patch)
    assert np.array_equal(live.numpy(), want)


def test_unsorted_and_repeated_positions_apply_as_decode_does():
    old, _ = pair(1000, 2)
    pos = np.array([900, 3, 500, 3], "<u4")  # 3 twice: the last value wins, as in decode
    vals = np.array([1, 2, 3, 4], "<u2")
    payload = np.concatenate(
        [np.array([4], "<u4").view(np.uint8), pos.view(np.uint8), vals.view(np.uint8)]
    )
    want = delta.decode("t", "sparse", payload, old, 2)
    patch = delta_patch.parse("t", "sparse", payload, old.size, 2)
    assert delta_patch.checksum_after("sha256", old, patch) == reference_checksum("sha256", want)
    live = torch.from_numpy(old.copy())
    delta_patch.write(live, patch)
    assert np.array_equal(live.numpy(), want)


def test_a_wrong_checksum_is_refused_and_the_base_is_left_alone():
    old, new = pair(5000, 2)
    patch = delta_patch.parse("t", "sparse", delta.encode("sparse", new, old, 2), old.size, 2)
    before = old.copy()
    with pytest.raises(Conflict):
        delta_patch.check("t", "sha256", old, patch, delta.checksum("sha256", old))
    assert np.array_equal(old, before)


@pytest.mark.parametrize("chunk", [7, 4096, 1 << 18])
@pytest.mark.parametrize(
    ("encoding", "width"), [("sparse", 2), ("sparse", 4), ("overwrite", 1), ("xor", 1)]
)
def test_patch_checked_writes_the_new_bytes_and_restore_puts_back_the_old(
    monkeypatch, chunk, encoding, width
):
    monkeypatch.setattr(delta_patch, "CHUNK", chunk)
    old, new = pair(30_011, width, seed=3)
    patch = delta_patch.parse(
        "t", encoding, delta.encode(encoding, new, old, width), old.size, width
    )
    live = old.copy()
    got, saved = delta_patch.patch_checked("xxh3-128", live, patch)
    assert np.array_equal(live, new)
    assert got == reference_checksum("xxh3-128", new)
    delta_patch.restore(live, patch, saved)
    assert np.array_equal(live, old)
