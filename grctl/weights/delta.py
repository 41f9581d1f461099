"""Delta weight syncs: the changed bytes of a step, applied onto the served weights.

A delta is a version directory, the layout miles' disk-delta transport publishes:

    SOURCE/weight_v000007/model.safetensors.index.json
        {"metadata": {"version": "000007", "base_version": "000006", "delta_encoding": "xor",
                      "compression_format": "none", "checksum_format": "sha256"},
         "weight_map": {"model.norm.weight": "model-00000-of-00001.safetensors", ...}}
    SOURCE/weight_v000007/model-00000-of-00001.safetensors
        one uint8 tensor per changed HF tensor (its encoded delta); the file's metadata maps
        each name to the checksum of that tensor's complete new bytes

Encodings are byte-wise over the tensor's bytes in the served dtype: `xor` is new ^ base (as
long as the tensor; applying it twice reverts it), `overwrite` is a little-endian u4 count, that
many u4 byte positions, then the new byte at each (idempotent); `sparse` (grctl's own) is
`overwrite` by element: u4 count, u4 element positions, then each new element's bytes in the
served dtype (2 bytes a value for bf16: the smallest uncompressed delta). Compression: `none`,
or `zstd` where the zstandard package is installed. Checksums: `sha256`, `adler32`, and `blake3` or
`xxh3-128` where their packages are installed.

Torn-sync rules: the delta names its base (`base_version`), and it is refused (409) unless the
served weights all carry that label; every tensor's delta is parsed and the state it makes is
checked against its final-state checksum before anything is written (delta_patch.py: over the
served bytes patched chunk by chunk, no copy of the tensor), so a bad delta (a wrong base, a
corrupt file, positions out of range) changes nothing. The writes are planned by the one sink
(apply.py) like any other source's, and write only the changed elements.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from grctl import confined
from grctl.errors import Conflict, GrctlError, NotFound, ValidationError
from grctl.weights import apply, delta_patch
from grctl.weights.mapping import resolve

if TYPE_CHECKING:
    from grctl.weights.updater import UpdateOutcome, WeightUpdater

INDEX = "model.safetensors.index.json"
ENCODINGS = ("xor", "overwrite", "sparse")
MAX_INDEX_BYTES = 16 << 20


def version_dir(source_dir: str | Path, version: int) -> Path:
    return Path(source_dir) / f"weight_v{int(version):06d}"


def checksum(algorithm: str, data: np.ndarray) -> str:
    h = delta_patch.hasher(algorithm)
    h.update(memoryview(np.ascontiguousarray(data)).cast("B"))
    return h.hexdigest()


def encode(encoding: str, new: np.ndarray, old: np.ndarray, width: int = 1) -> np.ndarray | None:
    """The delta of one tensor's bytes (uint8 arrays of one length, elements of `width` bytes:
    `sparse` uses it); None when unchanged."""
    if encoding == "xor":
        diff = np.bitwise_xor(new, old)
        return diff if diff.any() else None
    if encoding not in ENCODINGS:
        raise ValidationError(f"unknown delta_encoding {encoding!r}", hint=f"use {ENCODINGS}")
    a, b = _units(new, width, encoding), _units(old, width, encoding)
    pos = np.flatnonzero(a != b).astype("<u4")
    if not pos.size:
        return None
    head = np.array([pos.size], "<u4").view(np.uint8)
    return np.concatenate([head, pos.view(np.uint8), a[pos].reshape(-1).view(np.uint8)])


def _units(data: np.ndarray, width: int, encoding: str) -> np.ndarray:
    """The bytes as the encoding's units: one element each for `sparse` (opaque `width`-byte
    items where numpy has no integer that wide), one byte each for `overwrite`."""
    w = width if encoding == "sparse" else 1
    if w in (1, 2, 4, 8):
        return data.view(f"<u{w}")
    return data.view(np.dtype((np.void, w)))


def decode(
    name: str, encoding: str, payload: np.ndarray, base: np.ndarray, width: int = 1
) -> np.ndarray:
    """`base` (uint8, not modified) with one tensor's delta applied: a new array. `width`: the
    served dtype's element size (a `sparse` delta's unit). The payload is checked by
    delta_patch.parse, the in-place apply's own reading of it."""
    patch = delta_patch.parse(name, encoding, payload, base.size, width)
    if patch.xor is not None:
        return np.bitwise_xor(base, patch.xor)
    out = base.copy()
    _units(out, patch.width, "sparse")[patch.pos] = patch.values
    return out


def _decompress(name: str, fmt: str, raw: np.ndarray, limit: int, exact: int | None) -> np.ndarray:
    """The payload of one tensor's delta, decompressed. A zstd frame is bounded before anything
    is allocated: python-zstandard sizes its output by the content size the frame header
    declares (and ignores `max_output_size` then), so that size is checked first: `exact`
    bytes where the encoding fixes the length (xor), at most `limit` otherwise. A frame that
    declares no size is decompressed into a buffer of `limit` bytes, which it may not exceed."""
    if fmt in ("none", None):
        return raw
    if fmt != "zstd":
        raise ValidationError(f"unknown compression_format {fmt!r}", hint="use none or zstd")
    try:
        import zstandard
    except ImportError as exc:
        raise ValidationError(
            "compression_format 'zstd' needs the zstandard package on the server",
            hint="install zstandard, or publish uncompressed (compression_format none)",
        ) from exc
    data = raw.tobytes()
    try:
        declared = zstandard.frame_content_size(data)
        if declared not in (-1, zstandard.CONTENTSIZE_UNKNOWN) and (
            declared > limit or (exact is not None and declared != exact)
        ):
            want = f"exactly {exact}" if exact is not None else f"at most {limit}"
            raise ValidationError(
                f"delta of {name!r} is a zstd frame declaring {declared} bytes; its delta is "
                f"{want} bytes (refused before decompressing)"
            )
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise ValidationError(f"delta of {name!r} is not valid zstd (or too large): {exc}") from exc
    return np.frombuffer(out, dtype=np.uint8)


def read_index(vdir: Path, root: Path | None = None) -> dict:
    """The version's index, opened as a plain file (never through a symlink) and, with a
    `root` (--weights-root), checked to lie inside it through its descriptor."""
    path = vdir / INDEX
    try:
        data = confined.read_bytes(path, root=root, what=INDEX, limit=MAX_INDEX_BYTES)
    except FileNotFoundError:
        raise NotFound(
            f"no delta at {str(vdir)!r} ({INDEX} missing)",
            hint="publish the version first (grctl.client.delta.DeltaPublisher)",
        ) from None
    except OSError as exc:
        raise ValidationError(f"{INDEX} of {str(vdir)!r} cannot be read: {exc.strerror}") from None
    try:
        index = json.loads(data)
        meta, weight_map = index["metadata"], index["weight_map"]
        assert isinstance(meta, dict) and isinstance(weight_map, dict)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise ValidationError(
            f"{INDEX} of {str(vdir)!r} is not a delta index (metadata and weight_map)"
        ) from exc
    if meta.get("delta_encoding") not in ENCODINGS:
        raise ValidationError(
            f"delta_encoding {meta.get('delta_encoding')!r} is not one of {list(ENCODINGS)}"
        )
    for f in set(weight_map.values()):
        if "/" in f or "\\" in f or f.startswith(".") or not f.endswith(".safetensors"):
            raise ValidationError(f"weight_map names file {f!r}: a .safetensors file in the dir")
    return index


def same_version(a: object, b: object) -> bool:
    """Labels as miles writes them ('000006') and as an update sets them ('6') are one."""
    a, b = str(a), str(b)
    if a == b:
        return True
    return a.isdigit() and b.isdigit() and int(a) == int(b)


def plan_delta(updater: WeightUpdater, vdir: Path, root: Path | None = None):
    """Inside the update's turn: check the base, parse every tensor's delta (bounds, sizes,
    names), plan the writes. Returns (writes, {name: (the served view, its patch, the checksum
    of its new state)}, the checksum format); raises before any write. The checksums are the
    caller's to check (update_from_delta)."""
    index = read_index(vdir, root)
    meta = index["metadata"]
    versions = updater.versions
    base = str(meta.get("base_version"))
    if versions.is_mixed or not updater.engine.gate.is_consistent:
        raise Conflict(
            "the served weights are mixed or torn: no delta has them as its base",
            hint="sync a whole checkpoint first (update_weights_from_disk or a full push)",
        )
    if not same_version(base, versions.current):
        raise Conflict(
            f"the delta's base is version {base!r}; the served weights are {versions.current!r}",
            hint="publish a delta against the served version, or sync a whole checkpoint",
        )
    cfg, params = updater.model.config, apply.live_parameters(updater.model)
    algorithm, enc = str(meta.get("checksum_format")), meta["delta_encoding"]
    checksum(algorithm, np.zeros(0, np.uint8))  # an unknown or unavailable format: a 400
    found = each_tensor(
        vdir,
        index,
        lambda st, sums, name: _parse_one(st, sums, name, enc, meta, cfg, params),
        root,
    )
    views = {name: cur for name, (cur, _, _) in found.items()}
    writes = apply.plan_against(cfg, params, apply.specs_of(views.items()), require_full=False)
    return writes, found, algorithm


def each_tensor(vdir: Path, index: dict, decode, root: Path | None = None) -> dict:
    """{name: decode(file, its checksums, name)} for every tensor a delta version's index names,
    file by file; a missing file, a symlink, a file outside `root` (--weights-root, checked
    through its descriptor: confined.py) or one safetensors cannot read is a 4xx."""
    by_file: dict[str, list[str]] = {}
    for name, f in index["weight_map"].items():
        by_file.setdefault(f, []).append(name)
    from safetensors import safe_open

    out = {}
    for f, names in sorted(by_file.items()):
        path = vdir / f
        try:
            with (
                confined.opened(path, root=root, what="delta file", follow=False) as fd_name,
                safe_open(fd_name, framework="np") as st,
            ):
                sums = st.metadata() or {}
                for name in names:
                    out[name] = decode(st, sums, name)
        except GrctlError:
            raise
        except FileNotFoundError:
            raise ValidationError(f"delta file {str(path)!r} is missing") from None
        except Exception as exc:  # safetensors' own errors: a corrupt or foreign file
            raise ValidationError(f"delta file {str(path)!r} is unreadable: {exc}") from exc
    return out


def _parse_one(st, sums, name, enc, meta, cfg, params):
    """One tensor's delta read and parsed against the served tensor it patches: (the live view,
    the patch, the checksum of its new state). Checked later, all at once (check_all)."""
    target = resolve(name, cfg)
    if target is None or target.param_name not in params:
        raise ValidationError(f"delta names {name!r}: not a tensor of the served model")
    param = params[target.param_name]
    cur = param[target.row_start : target.row_end] if target.is_shard else param
    nbytes = cur.numel() * cur.element_size()
    payload = payload_of(st, sums, name, meta, nbytes)
    return cur, delta_patch.parse(name, enc, payload, nbytes, cur.element_size()), sums[name]


def payload_of(st, sums, name, meta, nbytes: int) -> np.ndarray:
    """One tensor's delta payload read from an open delta file and decompressed, after the
    checks every encoding shares (a 1-D uint8 tensor, a size no delta of it exceeds, a
    checksum of its new state present)."""
    if name not in st.keys():
        raise ValidationError(f"delta file has no tensor {name!r} its index names")
    sl = st.get_slice(name)
    if sl.get_dtype() not in ("U8", "u8", "uint8") or len(sl.get_shape()) != 1:
        raise ValidationError(f"delta of {name!r} must be a 1-D uint8 tensor")
    if sl.get_shape()[0] > 4 + 5 * nbytes:
        raise ValidationError(f"delta of {name!r} is larger than any delta of its tensor")
    if name not in sums:
        raise ValidationError(f"delta of {name!r} carries no checksum of its new state")
    enc = meta["delta_encoding"]
    limit, exact = 4 + 5 * nbytes, (nbytes if enc == "xor" else None)
    return _decompress(name, meta.get("compression_format"), st.get_tensor(name), limit, exact)


def decoded(st, sums, name, enc, algorithm, meta, base: np.ndarray, width: int) -> np.ndarray:
    """One tensor of an open delta file applied onto `base` (its current bytes) and checked
    against its final-state checksum: the new bytes, or a 400/409 before anything is written."""
    payload = payload_of(st, sums, name, meta, base.size)
    out = decode(name, enc, payload, base, width)
    if checksum(algorithm, out) != sums[name]:
        raise Conflict(
            f"tensor {name!r} after the delta does not match its checksum: the delta was made "
            "against other weights than the served ones, or it is corrupt",
            hint="nothing was written; sync a whole checkpoint, then deltas against it",
        )
    return out


def update_from_delta(
    updater: WeightUpdater,
    vdir: Path,
    *,
    weight_version: str | None,
    root: Path | None = None,
    **options,
) -> UpdateOutcome:
    """Apply one delta version through the updater (its turn, exclusive section, labels).

    CPU weights of a paused engine: each tensor patched in place and hashed in one pass
    (delta_patch.patch_checked: one read of it, a write of the lines the delta touches); if any
    checksum differs, every tensor written is restored before the update is refused (409), so
    nothing changed. A serving engine, or weights on another device: every tensor checked
    first while the engine serves (the served bytes patched chunk by chunk in a buffer), then
    the engine is held only while the changed elements are written. `root` (--weights-root)
    confines every file it opens."""
    run = _DeltaApply(updater, vdir, root)
    # is_full: the delta's version is the whole model (the tensors it leaves are unchanged in it)
    return updater.run(
        run.validate,
        run.fetch,
        read_into=run.write,
        after_copy=run.after_copy,
        weight_version=weight_version,
        is_full=True,
        **options,
    )


class _DeltaApply:
    def __init__(self, updater: WeightUpdater, vdir: Path, root: Path | None):
        self.updater, self.vdir, self.root = updater, vdir, root
        self.found: dict[str, tuple[torch.Tensor, delta_patch.Patch, str]] = {}
        self.algorithm, self.in_place = "", False
        self.done: list[tuple[str, np.ndarray, delta_patch.Patch, np.ndarray | None]] = []
        self.mismatched: list[str] = []  # list.append is atomic: writes run on threads

    def validate(self) -> list[apply.Write]:
        writes, self.found, self.algorithm = plan_delta(self.updater, self.vdir, self.root)
        # one pass in the hold when nothing is served meanwhile anyway (the caller paused);
        # else the check runs first, while the engine serves, and the hold only writes
        on_cpu = all(w.dst.device.type == "cpu" and w.dst.is_contiguous() for w in writes)
        self.in_place = on_cpu and self.updater.engine.gate.is_paused
        written = {w.name for w in writes}
        # checked before the pause: everything off the CPU, and any tensor the plan writes
        # through another name (a tied head beside its embedding)
        first = [(n, *self.found[n]) for n in self.found if not self.in_place or n not in written]
        delta_patch.check_all(self.algorithm, first, apply.read_workers())
        return writes

    def write(self, name: str, dst: torch.Tensor) -> bool:
        _, patch, want = self.found[name]
        if not self.in_place:
            delta_patch.write(dst, patch)
            return True
        live = delta_patch.host_bytes(dst)  # the parameter's own bytes (a contiguous CPU view)
        got, saved = delta_patch.patch_checked(self.algorithm, live, patch)
        self.done.append((name, live, patch, saved))
        if got != want:
            self.mismatched.append(name)
        return True

    def after_copy(self) -> None:
        """A checksum that differed: every tensor written put back, then the refusal."""
        if not self.mismatched:
            return
        try:
            for _, live, patch, saved in reversed(self.done):
                delta_patch.restore(live, patch, saved)
        except Exception as exc:  # not put back: the tensors it wrote are torn
            raise apply.WeightCopyError(
                f"a delta's checksum differed and its writes could not be undone: {exc}",
                touched=tuple(name for name, *_ in self.done),
            ) from exc
        raise delta_patch.mismatch(sorted(self.mismatched)[0])

    def fetch(self, name: str) -> torch.Tensor:
        raise AssertionError(f"{name!r}: a delta writes in place")  # write() takes every one
