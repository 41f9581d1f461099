"""Source-side digests and the comparison with a server's /weights_checker checksum.

The server hashes each HF-named view of its live parameters in the served dtype; the same
digest comes from the pushed tensor (from a checkpoint, or held in memory) cast to that dtype
(`tensor_sha256`). Tensors the served model does not hold (a tied lm_head, rotary buffers) are
not compared.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from grctl.client.outcome import ServerOutcome
from grctl.errors import GrctlError
from grctl.model import dtypes
from grctl.protocol.weights import WeightsCheckerResponse
from grctl.weights.checker import tensor_sha256
from grctl.weights.checkpoint import Checkpoint


def dtype_of(name: str) -> torch.dtype | None:
    return dtypes.from_name(name)


class CheckpointDigests:
    """sha256 of every tensor of a source cast to a dtype, computed once per dtype and name.
    `source`: a checkpoint path (opened here), or an open Checkpoint or NamedTensors (the
    caller's: left open)."""

    def __init__(self, source):
        self._source = None if isinstance(source, (str, os.PathLike)) else source
        self.path = Path(source) if self._source is None else None
        self._cache: dict[tuple[str, torch.dtype], str] = {}
        self._ckpt = None
        self._names: set[str] = set()

    def _open(self):
        if self._ckpt is None:
            self._ckpt = self._source or Checkpoint(self.path)
            self._names = {s.name for s in self._ckpt.specs()}
        return self._ckpt

    def digest(self, name: str, dtype: torch.dtype) -> str | None:
        """None when the checkpoint has no tensor of that name."""
        ckpt = self._open()
        if name not in self._names:
            return None
        key = (name, dtype)
        if key not in self._cache:
            t = ckpt.fetch(name)
            self._cache[key] = tensor_sha256(t.to(dtype) if t.is_floating_point() else t)
        return self._cache[key]

    def close(self) -> None:
        if self._ckpt is not None and self._source is None:
            self._ckpt.close()
        self._ckpt = None


def mismatches(checker: WeightsCheckerResponse, digests: CheckpointDigests) -> list[str]:
    """Every tensor whose server digest differs from the checkpoint's, with why."""
    if not checker.tensors:
        return ["the server returned no checksums (is it grctl with --allow-weight-update?)"]
    bad = []
    for name, served in sorted(checker.tensors.items()):
        dtype = dtype_of(served.dtype)
        if dtype is None:
            bad.append(f"{name}: server reports unknown dtype {served.dtype!r}")
            continue
        expected = digests.digest(name, dtype)
        if expected is None:
            bad.append(f"{name}: missing from the checkpoint")
        elif expected != served.sha256:
            bad.append(f"{name}: sha256 differs ({served.dtype})")
    return bad


def read_server(client, out: ServerOutcome, version: str | None, checksum: bool):
    """After a sync: the version the server reports (must be `version` when one was pushed),
    then, with `checksum`, its /weights_checker digests (None when not asked or failed)."""
    try:
        out.weight_version = client.get_weight_version().weight_version
    except Exception as exc:
        out.fail("verify", exc)
        return None
    if version is not None and out.weight_version != version:
        out.fail("verify", f"the server reports version {out.weight_version!r}")
    if not (checksum and out.ok):
        return None
    try:
        return client.weights_checker("checksum")
    except Exception as exc:
        out.fail("verify", exc)
        return None


def compare_servers(checks: list[tuple[ServerOutcome, WeightsCheckerResponse]], source) -> None:
    """Each server's digests against the source's (see CheckpointDigests), read once for the
    whole fleet."""
    digests = CheckpointDigests(source)
    try:
        for out, check in checks:
            out.mismatches = mismatches(check, digests)
            out.verified = not out.mismatches
            if out.mismatches:
                shown = ", ".join(out.mismatches[:8])
                out.fail(
                    "verify", f"{len(out.mismatches)} tensor(s) differ from the checkpoint: {shown}"
                )
    except GrctlError as exc:  # e.g. the checkpoint is not readable here
        for out, _ in checks:
            out.fail("verify", exc)
    finally:
        digests.close()
