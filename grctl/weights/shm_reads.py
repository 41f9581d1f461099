"""A pushed chunk's shared-memory tensors, read with pread from their segments into the sink.

A CPU tensor on the wire lies in a named POSIX shared-memory segment of the sender (torch's
file_system strategy: a 64-byte header, then the data). Decoding maps it, as torch does (the
mapping holds the reference the sender lent, and unmapping gives it back), but the bytes are
never read through that mapping: the sink's `read_into` preads each tensor from the segment's
file straight into its parameter, on the sink's read threads, as a checkpoint on disk is read.

Why: the copy through the mapping (torch's copy_ on its OpenMP threads, from pages a fresh
mapping faults in on every push) ran well below the speed of the same bytes read with pread on
the sink's read threads, as the server reads a checkpoint (docs/benchmarks.md); and a segment the
sender truncates while the server reads it is a short read here (OSError: the copy fails, the
tensors it began are torn and nothing is served from them until they are written again), where
a read through the mapping would kill the server with SIGBUS. What `read_into` does not take is
copied through the mapping by the sink, as before: a tensor that needs a cast (an Arena of
float32 sent to a bfloat16 server; grctl's staged buckets are cast by the client), a
non-contiguous one (a `direct` payload's views), any tensor on a torch that does not keep a
storage's Python object.

`read_hooks`: called with the segment's path and the tensor's name before each read. Empty in
production; tests install a fault there (grctl.testing.faults).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from grctl.weights.checkpoint import pread_exact
from grctl.weights.wire.rebuilds import segment_of
from grctl.weights.wire.segments import SHM_HEADER

read_hooks: list[Callable[[str, str], None]] = []


class SegmentReads:
    """The segments of one decoded chunk, each opened once; `close()` after the copy."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        # name -> (fd, path, byte offset, dtype, shape)
        self._where: dict[str, tuple[int, str, int, torch.dtype, tuple[int, ...]]] = {}
        self._fds: dict[bytes, tuple[int, str]] = {}
        try:
            for name, tensor in named:
                handle = segment_of(tensor)
                if handle is None or not tensor.is_contiguous():
                    continue
                if handle not in self._fds:
                    path = "/dev/shm" + os.fsdecode(handle)
                    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
                    self._fds[handle] = (os.open(path, flags), path)
                fd, path = self._fds[handle]
                offset = SHM_HEADER + tensor.storage_offset() * tensor.element_size()
                self._where[name] = (fd, path, offset, tensor.dtype, tuple(tensor.shape))
        except OSError:  # the segment's name is gone: read what is left through the mapping
            self._where.clear()

    def __len__(self) -> int:
        return len(self._where)

    def read_into(self, name: str, dst: torch.Tensor) -> bool:
        """Read tensor `name` straight into `dst` (a live parameter view) when it needs no
        conversion; False: the sink copies what `fetch` gives."""
        if name not in self._where:
            return False
        dtype, shape = self._where[name][3:]
        if dst.device.type != "cpu" or dst.dtype != dtype or not dst.is_contiguous():
            return False
        if tuple(dst.shape) != shape:
            return False
        self._read(name, dst)
        return True

    def _read(self, name: str, out: torch.Tensor) -> None:
        fd, path, offset = self._where[name][:3]
        for hook in read_hooks:
            hook(path, name)
        pread_exact(fd, out, offset, f"shared-memory segment {path} was truncated while read")

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._where.clear()
