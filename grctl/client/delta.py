"""Delta syncs from the trainer's side: publish only the bytes a step changed, then pull them.

    pub = DeltaPublisher("/shared/deltas")            # a directory the server can read
    pub.snapshot(model.state_dict(), version=0)       # what the server serves now (its base)
    ...                                               # a training step
    stats = pub.publish(model.state_dict())           # writes weight_v000001/: changed bytes
    pull_weights("http://127.0.0.1:8000", "/shared/deltas", stats.version)

The tensors are HF-named and in the served dtype (cast them first: the delta is byte-wise over
the served tensor's bytes). Each version is written under a temporary name and renamed into
place whole, so a server never reads half a version. The layout and the encodings are
grctl/weights/delta.py's (miles' disk-delta layout, uncompressed); `xor` is the smaller and
must be applied once (uncompressed, it is as large as the tensor: kept for miles' layout),
`overwrite` (changed byte positions and bytes) and `sparse` (changed element positions and
values, the default: 6 bytes a changed bf16 element) may be applied again.
The publisher's snapshot is the next delta's base: if a pull fails, sync a whole checkpoint and
snapshot again.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

from grctl.errors import GrctlError
from grctl.weights.delta import INDEX, checksum, encode, version_dir


@dataclass
class DeltaStats:
    version: int
    path: str
    changed_tensors: int
    changed_bytes: int  # bytes of the tensors whose values differ (in the served dtype)
    total_bytes: int  # bytes of every tensor compared
    wire_bytes: int  # bytes of the files written
    elapsed_ms: float


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


def _pairs(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
    return named.items() if isinstance(named, Mapping) else named


def default_checksum() -> str:
    """xxh3-128 where xxhash is installed (grctl[delta]; about 10x sha256's rate: the server
    hashes every byte of each changed tensor before a delta's writes), else sha256."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3-128"


class DeltaPublisher:
    def __init__(
        self,
        source_dir: str | Path,
        *,
        encoding: str = "sparse",
        checksum_format: str | None = None,
    ):
        self.source_dir = Path(source_dir)
        self.encoding = encoding
        self.checksum_format = checksum_format or default_checksum()
        self.version: int | None = None
        self._base: dict[str, np.ndarray] = {}

    def snapshot(self, named_tensors, version: int = 0) -> None:
        """Record the weights the server serves now (labelled `version`) as the next base."""
        self._base = {n: _bytes_of(t).copy() for n, t in _pairs(named_tensors)}
        self.version = int(version)

    def publish(self, named_tensors) -> DeltaStats:
        """Write the delta from the snapshot to `named_tensors` as version+1 (the next base)."""
        if self.version is None:
            raise GrctlError("no base: call snapshot() with the served weights first")
        t0 = time.perf_counter()
        version = self.version + 1
        payloads: dict[str, np.ndarray] = {}
        sums: dict[str, str] = {}
        new_base: dict[str, np.ndarray] = {}
        changed = total = 0
        for name, t in _pairs(named_tensors):
            new = _bytes_of(t)
            old = self._base.get(name)
            if old is None or old.size != new.size:
                raise GrctlError(
                    f"tensor {name!r} is not in the snapshot with its size; a delta changes "
                    "values only: sync a whole checkpoint and snapshot again"
                )
            total += new.size
            diff = encode(self.encoding, new, old, t.element_size())
            if diff is None:
                continue
            payloads[name], sums[name] = diff, checksum(self.checksum_format, new)
            new_base[name] = new.copy()
            changed += new.size
        wire, final = write_version(
            self.source_dir,
            version,
            f"{self.version:06d}",
            payloads,
            sums,
            encoding=self.encoding,
            checksum_format=self.checksum_format,
        )
        self._base.update(new_base)
        self.version = version
        ms = (time.perf_counter() - t0) * 1000.0
        return DeltaStats(version, str(final), len(payloads), changed, total, wire, ms)


def write_version(
    source_dir: Path,
    version: int,
    base_version: str,
    payloads: dict[str, np.ndarray],
    sums: dict[str, str],
    *,
    encoding: str,
    checksum_format: str,
) -> tuple[int, Path]:
    """`source_dir/weight_v{version:06d}`: the delta files (uncompressed) and their index,
    written under a temporary name and renamed into place whole. Returns (bytes written, the
    version directory)."""
    final = version_dir(source_dir, version)
    tmp = source_dir / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    if payloads:
        from safetensors.numpy import save_file

        fname = "model-00000-of-00001.safetensors"
        save_file(payloads, str(tmp / fname), metadata=sums)
        weight_map = dict.fromkeys(payloads, fname)
    meta = {
        "version": f"{version:06d}",
        "base_version": base_version,
        "delta_encoding": encoding,
        "compression_format": "none",
        "checksum_format": checksum_format,
    }
    (tmp / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": weight_map}))
    wire = sum(f.stat().st_size for f in tmp.iterdir())
    os.rename(tmp, final)
    return wire, final


def pull_weights(
    url: str,
    source_dir: str | Path,
    version: int,
    *,
    weight_version: str | int | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
) -> dict:
    """POST /pull_weights: the server applies `source_dir/weight_v{version:06d}` in place
    (GRClient.pull_weights). Returns the reply as a dict; raises the server's GrctlError."""
    from grctl.client.http import GRClient

    with GRClient(url, api_key=api_key, bearer=True, update_timeout=timeout) as gr:
        reply = gr.pull_weights(str(source_dir), int(version), weight_version=weight_version)
    return msgspec.to_builtins(reply)
