"""`grctl push --delta BASE`: a delta from a base checkpoint to a new one, made here and sent.

    with DeltaSync(urls, base="/ckpt/step_6", delta_dir="/shared/deltas") as sync:
        sync.run("/ckpt/step_7", weight_version=7)

The servers serve BASE. Before anything is paused, each tensor of the new checkpoint is read
with its base, both cast to the served dtype, and the changed elements written as one delta
version (grctl/weights/delta.py's layout, encoding `sparse`, xxh3-128 where xxhash is installed),
labelled with the version the servers report as its base; one version per (served label, served
dtype) when servers differ. Then the usual WeightSync: pause, flush, POST /pull_weights on each
server (which refuses a delta whose base label or changed tensors' final checksums do not match
what it serves: 409, nothing changed), continue, and, with verify, every served tensor's sha256
against the new checkpoint (this catches an unchanged tensor that differs from BASE too).

The version directory is made under `delta_dir` (default: a new hidden directory beside the
new checkpoint, removed after the push), which the servers must be able to read (and, with
--weights-root, inside it); a `delta_dir` given is kept, each push adding the next version.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from grctl.client.delta import default_checksum, write_version
from grctl.client.outcome import ServerOutcome, SyncResult
from grctl.client.sync import WeightSync
from grctl.client.verify import dtype_of
from grctl.errors import GrctlError, ValidationError
from grctl.weights.checkpoint import Checkpoint
from grctl.weights.delta import checksum, encode

VERSION_DIR = re.compile(r"weight_v(\d{6,})")


def make_delta(
    base: Checkpoint,
    new: Checkpoint,
    dtype: torch.dtype,
    source_dir: Path,
    base_version: str,
    *,
    encoding: str = "sparse",
    checksum_format: str | None = None,
) -> tuple[Path, int, int]:
    """The delta from `base` to `new` in `dtype`, written as the next version under
    `source_dir`. Returns (source_dir, the version, bytes written). Refuses checkpoints whose
    tensors differ in names or shapes (a delta changes values only)."""
    fmt = checksum_format or default_checksum()
    a = {s.name: s.shape for s in base.specs()}
    b = {s.name: s.shape for s in new.specs()}
    if a != b:
        diff = sorted(set(a) ^ set(b)) or sorted(n for n in a if a[n] != b[n])
        raise ValidationError(
            "--delta: the base and the new checkpoint differ in tensors or shapes ("
            + ", ".join(diff[:4])
            + (" ..." if len(diff) > 4 else "")
            + "); a delta changes values only",
            hint="push the new checkpoint whole (without --delta)",
        )
    payloads: dict[str, np.ndarray] = {}
    sums: dict[str, str] = {}
    for name in b:
        old_t, new_t = base.fetch(name).to(dtype), new.fetch(name).to(dtype)
        old_b, new_b = (
            t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in (old_t, new_t)
        )
        diff = encode(encoding, new_b, old_b, new_t.element_size())
        if diff is not None:
            payloads[name], sums[name] = diff, checksum(fmt, new_b)
    version = next_version(source_dir)
    wire, _ = write_version(
        source_dir, version, base_version, payloads, sums, encoding=encoding, checksum_format=fmt
    )
    return source_dir, version, wire


def next_version(source_dir: Path) -> int:
    """One past the highest weight_vNNNNNN already in `source_dir` (1 in a new one)."""
    found = [
        int(m.group(1))
        for p in source_dir.glob("weight_v*")
        if (m := VERSION_DIR.fullmatch(p.name))
    ]
    return max(found, default=0) + 1


class DeltaSync(WeightSync):
    """WeightSync whose push is a delta (see the module docstring): `base` the checkpoint the
    servers serve; `delta_dir` where the versions are written (None: a temporary directory
    beside the new checkpoint)."""

    def __init__(self, urls=None, *, base: str | Path, delta_dir: str | Path | None = None, **kw):
        super().__init__(urls, transport="disk", **kw)
        self.base = Path(base)
        self.delta_dir = None if delta_dir is None else Path(delta_dir)
        # (served label, served dtype) -> (its delta's directory, version, bytes written)
        self._made: dict[tuple[str, str], tuple[Path, int, int]] = {}

    def _update(self, result: SyncResult, source, version, token_step, catalog=None) -> None:
        """The deltas are made before the pause; then pause -> flush -> pull -> continue."""
        result.transport = "delta"
        new_path = Path(source)
        own = self.delta_dir is None
        try:
            source_dir = self.delta_dir or Path(
                tempfile.mkdtemp(prefix=".grctl-delta-", dir=new_path.resolve().parent)
            )
        except OSError as exc:
            raise GrctlError(
                f"--delta: cannot make a directory for the delta beside {str(new_path)!r}: {exc}",
                hint="name one the servers can read with --delta-dir",
            ) from exc
        try:
            source_dir.mkdir(parents=True, exist_ok=True)
            with Checkpoint(self.base) as base, Checkpoint(new_path) as new:
                for out in [o for o in result.servers if o.ok]:
                    try:
                        self._delta_for(out, base, new, source_dir.resolve())
                    except GrctlError as exc:
                        out.fail("plan", exc)
                    except (OSError, ValueError) as exc:
                        out.fail("plan", f"cannot make the delta: {exc}")
            super()._update(result, source, version, token_step, catalog)
        finally:
            if own:
                shutil.rmtree(source_dir, ignore_errors=True)

    def _delta_for(self, out: ServerOutcome, base: Checkpoint, new: Checkpoint, where: Path):
        key = (str(out.old_version), out.dtype)
        if key not in self._made:
            dtype = dtype_of(out.dtype)
            if dtype is None:
                raise ValidationError(f"the server serves dtype {out.dtype!r}, unknown here")
            self._made[key] = make_delta(base, new, dtype, where, str(out.old_version))
        _, _, out.num_bytes = self._made[key]

    def _push(self, result: SyncResult, source, version, token_step, catalog=None) -> None:
        """POST /pull_weights on every server still ok, its delta's version; the label: the one
        asked for, else the server's own (as a full push without one keeps it)."""
        t0 = time.perf_counter()

        def pull(out: ServerOutcome) -> None:
            where, v, _ = self._made[(str(out.old_version), out.dtype)]
            try:
                reply = self.clients[out.url].pull_weights(
                    str(where),
                    v,
                    weight_version=version if version is not None else out.old_version,
                    token_step=token_step,
                    catalog_path=catalog,
                )
            except Exception as exc:
                out.fail("push", exc)
                return
            out.num_tensors = reply.tensors_loaded

        list(self._pool.map(pull, [o for o in result.servers if o.ok]))
        result.timings["push"] = round(time.perf_counter() - t0, 4)
        for out in result.servers:
            out.timings.setdefault("push", result.timings["push"])
