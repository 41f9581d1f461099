"""A delta applied in place, without a copy of any tensor, and checked against its checksums.

delta.decode builds each new tensor whole (a copy of the served tensor, then the changes) and
an update would copy it over the served one: passes over every byte of every tensor a step
touched, for a delta that changes 2 % of them. Here the new state is never materialised. On
the CPU (`patch_checked`) the served tensor is patched in place chunk by chunk, each chunk hashed
right after its patch while it is in cache, the replaced values kept: one read of the tensor
and a write of the lines the delta touches, the least a checksum of the whole new state allows.
A tensor whose checksum then differs is put back from the kept values (`restore`), with every
other tensor the version wrote, before anything else runs, so a bad delta changes nothing;
nothing but this runs while the engine is held. Elsewhere (a CUDA tensor) the checksum runs
first over the served bytes copied to the host and patched chunk by chunk (`check_all`), then
only the changed elements are written (`write`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from grctl.errors import Conflict, ValidationError

CHUNK = 1 << 18  # bytes hashed per patched chunk: stays in cache (256 KiB measured best)


@dataclass
class Patch:
    """One tensor's delta, parsed and bounds-checked: `pos` (sorted u4 element positions of
    `width` bytes) and `values`, or for xor the whole `xor` payload."""

    encoding: str
    width: int
    pos: np.ndarray | None = None
    values: np.ndarray | None = None
    xor: np.ndarray | None = None


def parse(name: str, encoding: str, payload: np.ndarray, nbytes: int, width: int) -> Patch:
    """The payload's positions and values (views of it), checked as delta.decode checks."""
    if encoding == "xor":
        if payload.size != nbytes:
            raise ValidationError(
                f"delta of {name!r} has {payload.size} bytes; an xor delta is as long as the "
                f"served tensor ({nbytes} bytes in the served dtype)"
            )
        return Patch(encoding, 1, xor=payload)
    w = width if encoding == "sparse" else 1
    units = nbytes // w
    if payload.size < 4:
        raise ValidationError(f"{encoding} delta of {name!r} is shorter than its count")
    count = int(payload[:4].view("<u4")[0])
    if count > units or payload.size != 4 + (4 + w) * count:
        raise ValidationError(
            f"{encoding} delta of {name!r} is malformed: {payload.size} bytes for {count} "
            f"positions (a count at most {units}, then 4 + {4 + w} * count bytes in all; "
            f"{w}-byte values for the served dtype)"
        )
    pos = payload[4 : 4 + 4 * count].view("<u4")
    if count and int(pos.max()) >= units:
        raise ValidationError(
            f"{encoding} delta of {name!r} writes position {int(pos.max())}; the served tensor "
            f"has {units}"
        )
    values = _as_units(payload[4 + 4 * count :], w)
    if count > 1 and not bool(np.all(pos[1:] > pos[:-1])):  # another publisher's order
        order = np.argsort(pos, kind="stable")
        pos, values = pos[order], values[order]
        if bool(np.any(pos[1:] == pos[:-1])):  # the last write of a position wins
            keep = np.append(pos[1:] != pos[:-1], True)
            pos, values = pos[keep], values[keep]
    return Patch(encoding, w, pos=pos, values=values)  # u4 positions: numpy indexes with them


def _as_units(data: np.ndarray, width: int) -> np.ndarray:
    """uint8 bytes as one item per element: an integer view where numpy has one that wide
    (a 1-D scatter of integers is several times faster than one of byte rows)."""
    if width in (1, 2, 4, 8):
        return data.view(f"<u{width}")
    return data.reshape(-1, width)


def _chunk_ends(pos: np.ndarray, per_chunk: int, units: int) -> np.ndarray:
    """For each chunk of `per_chunk` units, the index in `pos` of its first position past it
    (one search for all chunks; the edges in pos's own dtype, so pos is not cast)."""
    edges = np.arange(per_chunk, units + per_chunk, per_chunk, dtype=np.int64)
    if units >= 1 << 32:  # past u4: search in int64 (pos is cast, once)
        return np.searchsorted(pos.astype(np.int64), edges)
    return np.searchsorted(pos, np.minimum(edges, units).astype(pos.dtype))


def hasher(algorithm: str):
    """The checksum_format's hash: an object with update(bytes) and hexdigest() (the one
    place a format names its library; delta.checksum is one update of it)."""
    if algorithm == "adler32":
        return _Adler32()
    if algorithm == "sha256":
        import hashlib

        return hashlib.sha256()
    try:
        if algorithm == "blake3":
            import blake3

            return blake3.blake3()
        if algorithm == "xxh3-128":
            import xxhash

            return xxhash.xxh3_128()
    except ImportError as exc:
        raise ValidationError(
            f"checksum_format {algorithm!r} needs the {exc.name!r} package on the server",
            hint="install it, or publish with sha256 or adler32",
        ) from exc
    raise ValidationError(
        f"unknown checksum_format {algorithm!r}",
        hint="use sha256, adler32, blake3 or xxh3-128",
    )


class _Adler32:
    def __init__(self) -> None:
        self.value = 1

    def update(self, data) -> None:
        import zlib

        self.value = zlib.adler32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def checksum_after(algorithm: str, base: np.ndarray, patch: Patch) -> str:
    """The checksum of `base` (uint8) with `patch` applied, base left as it is."""
    h = hasher(algorithm)
    nbytes, w = base.size, patch.width
    step = max(w, CHUNK // w * w)
    buf = np.empty(min(step, nbytes), np.uint8)
    pos = patch.pos if patch.pos is not None and patch.pos.size else None
    if pos is not None:  # each chunk's first position: one search for all of them
        ends = _chunk_ends(pos, step // w, nbytes // w)
    lo = 0
    for k, start in enumerate(range(0, nbytes, step)):
        end = min(start + step, nbytes)
        chunk = buf[: end - start]
        np.copyto(chunk, base[start:end])
        if patch.xor is not None:
            np.bitwise_xor(chunk, patch.xor[start:end], out=chunk)
        elif pos is not None:
            hi = int(ends[k])
            if hi > lo:
                _as_units(chunk, w)[pos[lo:hi] - start // w] = patch.values[lo:hi]
            lo = hi
        h.update(memoryview(chunk))
    return h.hexdigest()


def check_all(algorithm: str, items: list, workers: int = 1) -> None:
    """check() each (name, served tensor, patch, expected checksum) on `workers` threads (the
    hashes, copies and scatters release the GIL), the largest tensors first; raises the first
    mismatch. A tensor's host bytes are taken in its own turn (a CUDA tensor's copy lives only
    while it is checked)."""
    order = sorted(items, key=lambda it: it[1].numel() * it[1].element_size(), reverse=True)

    def one(item) -> None:
        name, tensor, patch, expected = item
        check(name, algorithm, host_bytes(tensor), patch, expected)

    if workers <= 1 or len(order) <= 1:
        for item in order:
            one(item)
        return
    with ThreadPoolExecutor(min(workers, len(order))) as pool:
        for done in [pool.submit(one, item) for item in order]:
            done.result()


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array (no copy of a contiguous CPU tensor)."""
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


def check(name: str, algorithm: str, base: np.ndarray, patch: Patch, expected: str) -> None:
    if checksum_after(algorithm, base, patch) != expected:
        raise mismatch(name)


def mismatch(name: str) -> Conflict:
    return Conflict(
        f"tensor {name!r} after the delta does not match its checksum: the delta was made "
        "against other weights than the served ones, or it is corrupt",
        hint="nothing was written; sync a whole checkpoint, then deltas against it",
    )


def patch_checked(algorithm: str, live: np.ndarray, patch: Patch) -> tuple[str, np.ndarray | None]:
    """Apply `patch` to `live` (a served tensor's uint8 bytes) in place, hashing each chunk once
    it is patched: (the checksum of the new bytes, the values the patch replaced, for
    `restore`; None for xor, which undoes itself)."""
    h = hasher(algorithm)
    nbytes, w = live.size, patch.width
    step = max(w, CHUNK // w * w)
    pos = patch.pos if patch.pos is not None and patch.pos.size else None
    saved = None
    if pos is not None:
        assert patch.values is not None
        saved = np.empty_like(patch.values)
        ends = _chunk_ends(pos, step // w, nbytes // w)
    units, lo = _as_units(live, w), 0
    for k, start in enumerate(range(0, nbytes, step)):
        chunk = live[start : start + step]
        if patch.xor is not None:
            np.bitwise_xor(chunk, patch.xor[start : start + step], out=chunk)
        elif pos is not None:
            hi = int(ends[k])
            if hi > lo:  # the chunk's positions, absolute: no index arithmetic, no temporaries
                at = pos[lo:hi]
                np.take(units, at, axis=0, out=saved[lo:hi])
                units[at] = patch.values[lo:hi]
            lo = hi
        h.update(memoryview(chunk))
    return h.hexdigest(), saved


def restore(live: np.ndarray, patch: Patch, saved: np.ndarray | None) -> None:
    """Undo patch_checked: the replaced values back (or the xor applied again)."""
    if patch.xor is not None:
        np.bitwise_xor(live, patch.xor, out=live)
    elif saved is not None and patch.pos is not None:
        _as_units(live, patch.width)[patch.pos] = saved


def write(dst: torch.Tensor, patch: Patch) -> None:
    """Apply the patch to the live tensor `dst` (contiguous) in place."""
    flat = dst.view(torch.uint8).reshape(-1)
    if patch.xor is not None:
        src = torch.from_numpy(patch.xor).to(flat.device)
        flat.bitwise_xor_(src)
        return
    assert patch.pos is not None and patch.values is not None
    if not patch.pos.size:
        return
    if flat.device.type == "cpu":
        _as_units(flat.numpy(), patch.width)[patch.pos] = patch.values
        return
    pos = torch.from_numpy(patch.pos.astype(np.int64)).to(flat.device)
    vals = torch.from_numpy(np.ascontiguousarray(patch.values).view(np.uint8)).to(flat.device)
    flat.view(-1, patch.width)[pos] = vals.view(-1, patch.width)
