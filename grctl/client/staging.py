"""Tensor buckets for update_weights_from_tensor, staged on the server's device.

A plan is made from the checkpoint's headers alone (names, shapes, dtypes): tensors in
checkpoint order, a new bucket when the next tensor would pass the budget, and a tensor larger
than the budget alone in its own bucket (slime's rule). Staging a bucket reads its tensors (from
a checkpoint, lazily, or from a trainer's memory: client.sources) straight into one flat uint8
buffer: POSIX shared memory for a CPU server, device memory for a CUDA one, cast on the way to
the served dtype, so the payload carries one shared-memory name or one CUDA IPC handle per
bucket and no tensor bytes cross HTTP.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grctl.errors import GrctlError
from grctl.weights.apply import TensorSpec
from grctl.weights.wire import encode
from grctl.weights.wire.records import FlattenedTensorMetadata

ALIGN = 16  # byte alignment of each tensor inside a bucket
MiB = 1 << 20


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype it travels in
    start: int  # byte offset inside the bucket

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    index: int
    entries: tuple[Entry, ...]
    nbytes: int  # the flat buffer's size, alignment included


def wire_dtype(spec: TensorSpec, served: torch.dtype | None) -> torch.dtype:
    """Floating tensors travel in the served dtype (the server would cast them anyway)."""
    if served is not None and spec.dtype.is_floating_point:
        return served
    return spec.dtype


def plan_buckets(
    specs: list[TensorSpec], served: torch.dtype | None, budget_bytes: int
) -> list[BucketPlan]:
    buckets: list[BucketPlan] = []
    entries: list[Entry] = []
    offset = 0

    def close() -> None:
        nonlocal entries, offset
        if entries:
            buckets.append(BucketPlan(len(buckets), tuple(entries), offset))
        entries, offset = [], 0

    for spec in specs:
        dtype = wire_dtype(spec, served)
        size = math.prod(spec.shape) * dtype.itemsize
        start = -(-offset // ALIGN) * ALIGN
        if entries and start + size > budget_bytes:
            close()
            start = 0
        entries.append(Entry(spec.name, tuple(spec.shape), dtype, start))
        offset = start + size
    close()
    return buckets


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor allocated in named POSIX shared memory (no copy into it later)."""
    encode.start_shm_manager_detached()
    new = getattr(torch.UntypedStorage, "_new_using_filename_cpu", None)
    try:
        if new is None:  # an older torch: allocate, then move into shared memory once
            return encode.share_for_ipc(torch.empty(nbytes, dtype=torch.uint8))
        return torch.empty(0, dtype=torch.uint8).set_(new(nbytes))
    except RuntimeError as exc:
        if "No space left" not in str(exc):
            raise
        raise no_shm_space(nbytes) from exc


class ShmFull(GrctlError):
    """/dev/shm too small for a bucket (Docker's default is 64 MiB); nothing was sent."""

    code, status = "shm_full", 0


def no_shm_space(nbytes: int) -> ShmFull:
    try:
        free = f"{shutil.disk_usage('/dev/shm').free / MiB:.0f} MiB free"
    except OSError:
        free = "its free space unknown"
    need = 2 * nbytes / MiB  # two buckets are alive at once (pipeline.py)
    return ShmFull(
        f"/dev/shm has no room for a {nbytes / MiB:.0f} MiB bucket ({free})",
        hint=f"use --transport disk, a smaller --bucket-mb, or a /dev/shm of at least "
        f"{need:.0f} MiB (docker run --shm-size)",
    )


class BufferPool:
    """`count` flat buffers of the largest bucket's size, allocated and touched once, then
    reused by every bucket: fresh shared memory costs a page fault and a zeroed page per 4 KiB
    on first write (1 s/GiB measured on the CPU, against 0.14 s/GiB into touched pages). A
    buffer comes back only when its bucket is freed, after every call carrying it returned
    (the protocol lets the client reuse its memory only after the server's reply)."""

    def __init__(self, nbytes: int, device: torch.device, count: int = 2):
        self._free: list[torch.Tensor] = []
        for _ in range(count):
            if device.type == "cpu":
                flat = shared_buffer(nbytes)
                flat.zero_()  # fault every page in now, once
            else:
                flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._free.append(flat)

    def take(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A buffer's first `nbytes` bytes and the call that gives the buffer back."""
        flat = self._free.pop()
        return flat[:nbytes], lambda: self._free.append(flat)


class StagedBucket:
    """One bucket's flat buffer and metadata. Alive until `free()`; the server reads it while a
    call that carries it is in flight, so free only after every such call has returned."""

    def __init__(
        self, plan: BucketPlan, flat: torch.Tensor, give_back: Callable[[], None] | None = None
    ):
        self.plan = plan
        self.flat: torch.Tensor | None = flat
        self._give_back = give_back
        self.metadata = [
            FlattenedTensorMetadata(
                e.name, torch.Size(e.shape), e.dtype, e.start, e.start + e.nbytes, e.nbytes
            )
            for e in plan.entries
        ]

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    def payload(self) -> str:
        """A fresh serialization for one receiver: each adds the shared-memory reference that
        one receiver's rebuild consumes, so a payload must never go to two servers."""
        return self.payload_and_shares()[0]

    def payload_and_shares(self) -> tuple[str, encode.Shares]:
        """The payload and what it lends the receiver (encode.Shares), to take back if the
        receiver never rebuilds it."""
        assert self.flat is not None, "bucket already freed"
        bucket = encode.FlattenedTensorBucket(flattened_tensor=self.flat, metadata=self.metadata)
        shares = encode.Shares()
        payload = bucket.to_payload()
        text = encode.MultiprocessingSerializer.serialize(payload, output_str=True, shares=shares)
        return text, shares

    def free(self) -> None:
        is_cuda = self.flat is not None and self.flat.is_cuda
        if self.flat is not None and self._give_back is not None:
            self._give_back()  # back to its pool, for the next bucket
        self.flat = None
        if is_cuda:
            torch.cuda.ipc_collect()  # release what the server has let go of (slime does this)


def stage(
    source, plan: BucketPlan, device: torch.device, pool: BufferPool | None = None
) -> StagedBucket:
    """Read the bucket's tensors from `source` (client.sources: a Checkpoint or NamedTensors)
    into one flat buffer on `device`: one of the pool's when given, else a fresh one."""
    give_back = None
    if pool is not None:
        flat, give_back = pool.take(plan.nbytes)
    elif device.type == "cpu":
        flat = shared_buffer(plan.nbytes)
    else:
        flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    for e in plan.entries:
        dst = flat[e.start : e.start + e.nbytes].view(e.dtype).view(e.shape)
        if not source.read_into(e.name, dst):  # a file read straight into the bucket
            dst.copy_(source.fetch(e.name))  # cast and device move in one copy
    if flat.is_cuda:
        torch.cuda.synchronize(device)  # the bytes are in place before any handle leaves
    return StagedBucket(plan, flat, give_back)
