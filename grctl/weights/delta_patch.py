"""A delta applied in place: checked against its checksum without a copy of the tensor, then
only the changed elements written.

delta.decode builds each new tensor whole (a copy of the served tensor, then the changes) and
the update copies it over the served one: two passes over every byte of every tensor a step
touched, plus a checksum over the copy, for a delta that changes 2 % of them. Here the new
state is never materialised: the checksum runs over the served bytes in cache-sized chunks,
each patched on the way (a copy of one chunk, not of the model), and the update writes only the
changed elements (`sparse`, `overwrite`) or xors the payload in (`xor`). The rules are
grctl/weights/delta.py's: every tensor of the version is decoded and checked before anything is
written, so a bad delta changes nothing; nothing here runs in the engine's pause but the writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grctl.errors import Conflict, ValidationError

CHUNK = 1 << 20  # bytes hashed per patched chunk: stays in cache


@dataclass
class Patch:
    """One tensor's delta, parsed and bounds-checked: `pos` (sorted element positions of
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
    return Patch(encoding, w, pos=pos.astype(np.int64), values=values)


def _as_units(data: np.ndarray, width: int) -> np.ndarray:
    """uint8 bytes as one item per element: an integer view where numpy has one that wide
    (a 1-D scatter of integers is several times faster than one of byte rows)."""
    if width in (1, 2, 4, 8):
        return data.view(f"<u{width}")
    return data.reshape(-1, width)


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
    lo_i = 0
    for start in range(0, nbytes, step):
        end = min(start + step, nbytes)
        chunk = buf[: end - start]
        np.copyto(chunk, base[start:end])
        if patch.xor is not None:
            np.bitwise_xor(chunk, patch.xor[start:end], out=chunk)
        elif patch.pos is not None and patch.pos.size:
            hi_i = int(np.searchsorted(patch.pos, end // w, side="left"))
            if hi_i > lo_i:
                units = _as_units(chunk, w)
                units[patch.pos[lo_i:hi_i] - start // w] = patch.values[lo_i:hi_i]
            lo_i = hi_i
        h.update(memoryview(chunk))
    return h.hexdigest()


def check(name: str, algorithm: str, base: np.ndarray, patch: Patch, expected: str) -> None:
    if checksum_after(algorithm, base, patch) != expected:
        raise Conflict(
            f"tensor {name!r} after the delta does not match its checksum: the delta was made "
            "against other weights than the served ones, or it is corrupt",
            hint="nothing was written; sync a whole checkpoint, then deltas against it",
        )


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
    pos = torch.from_numpy(patch.pos).to(flat.device)
    vals = torch.from_numpy(np.ascontiguousarray(patch.values).view(np.uint8)).to(flat.device)
    flat.view(-1, patch.width)[pos] = vals.view(-1, patch.width)
