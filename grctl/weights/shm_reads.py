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
a read through the mapping would kill the server with SIGBUS. What `read_into` does not take (a
tensor that needs a cast, such as an Arena of float32 sent to a bfloat16 server; a
non-contiguous one, such as a `direct` payload's views) `fetch` reads with pread into memory of
its own, for the sink to convert. Only a tensor whose segment is no longer in /dev/shm, or one
on a torch that does not keep a storage's Python object, is copied through the mapping.

The mapping's header, where torch keeps the segment's reference count, is taken private on
opening (grctl.weights.shm_header): letting the chunk go then never touches the sender's file
through the mapping, so a segment truncated to nothing cannot kill the server either.

`read_hooks`: called with the segment's path and the tensor's name before each read. Empty in
production; tests install a fault there (grctl.testing.faults).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from grctl.weights import shm_header
from grctl.weights.checkpoint import pread_exact
from grctl.weights.wire.rebuilds import segment_of
from grctl.weights.wire.segments import SHM_HEADER

read_hooks: list[Callable[[str, str], None]] = []


class SegmentReads:
    """The segments of one decoded chunk, each opened once; `close()` after the copy.

    On opening, each segment's mapping has its header taken private (shm_header.detach), so
    nothing torch does when the chunk is let go touches the sender's file through the mapping;
    `close()` gives the sender its reference back through the file."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        # name -> (fd, path, the decoded tensor): every tensor in a segment this server opened
        self._where: dict[str, tuple[int, str, torch.Tensor]] = {}
        self._fds: dict[bytes, tuple[int, str]] = {}
        self._detached: list[tuple[int, str]] = []  # (fd, path) whose reference we hold
        gone: set[bytes] = set()  # names no longer in /dev/shm: read through the mapping
        for name, tensor in named:
            handle = segment_of(tensor)
            if handle is None or handle in gone:
                continue
            if handle not in self._fds:
                path = "/dev/shm" + os.fsdecode(handle)
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:
                    gone.add(handle)
                    continue
                self._fds[handle] = (fd, path)
                storage = tensor.untyped_storage()
                if getattr(storage, "_grctl_mapped_here", False) and shm_header.detach(storage, fd):
                    self._detached.append((fd, path))
            fd, path = self._fds[handle]
            self._where[name] = (fd, path, tensor)

    def __len__(self) -> int:
        return len(self._where)

    def read_into(self, name: str, dst: torch.Tensor) -> bool:
        """Read tensor `name` straight into `dst` (a live parameter view) when it needs no
        conversion; False: the sink copies what `fetch` gives."""
        if name not in self._where:
            return False
        src = self._where[name][2]
        if dst.device.type != "cpu" or dst.dtype != src.dtype or not dst.is_contiguous():
            return False
        if tuple(dst.shape) != tuple(src.shape) or not src.is_contiguous():
            return False
        self._read(name, dst, src.storage_offset())
        return True

    def fetch(self, name: str, mapped: torch.Tensor) -> torch.Tensor:
        """Tensor `name` for the sink to copy and convert: read with pread into memory of its
        own (the span of the segment its strides cover) when it lies in an open segment, else
        `mapped`, the decoded view of the mapping."""
        if name not in self._where:
            return mapped
        src = self._where[name][2]
        if src.numel() == 0:
            return torch.empty_strided(src.shape, src.stride(), dtype=src.dtype)
        span = 1 + sum((n - 1) * st for n, st in zip(src.shape, src.stride(), strict=True))
        buf = torch.empty(span, dtype=src.dtype)
        self._read(name, buf, src.storage_offset())
        return buf.as_strided(src.shape, src.stride())

    def _read(self, name: str, out: torch.Tensor, start: int) -> None:
        fd, path, src = self._where[name]
        for hook in read_hooks:
            hook(path, name)
        offset = SHM_HEADER + start * src.element_size()
        pread_exact(fd, out, offset, f"shared-memory segment {path} was truncated while read")

    def close(self) -> None:
        try:
            for fd, path in self._detached:
                shm_header.give_back(fd, path)
        finally:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._detached.clear()
            self._fds.clear()
            self._where.clear()
