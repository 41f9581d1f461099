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

import ctypes
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from grctl.client.buffers import (  # noqa: F401 (the buffers are named here too)
    BufferPool,
    MiB,
    ShmFull,
    no_shm_space,
    shared_buffer,
)
from grctl.weights import apply
from grctl.weights.apply import TensorSpec
from grctl.weights.checkpoint import Checkpoint
from grctl.weights.wire import encode
from grctl.weights.wire.records import FlattenedTensorMetadata

ALIGN = 16  # byte alignment of each tensor inside a bucket
# Below this many elements torch copies on the calling thread (its parallel grain size): a
# cast staged in pieces this small never starts an OpenMP region.
SERIAL_ELEMENTS = 32_767
# At most this many threads read a checkpoint into a bucket (the server's read-thread count,
# which follows torch's: a trainer with many torch threads gains nothing from more).
MAX_READERS = 4


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
    in_place = getattr(source, "bucket_view", None)
    flat = in_place(plan) if callable(in_place) else None
    if flat is not None and flat.device == device:
        return StagedBucket(plan, flat)  # the source's own memory: nothing to copy
    give_back = None
    if pool is not None:
        flat, give_back = pool.take(plan.nbytes)
    elif device.type == "cpu":
        flat = shared_buffer(plan.nbytes)
    else:
        flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    try:
        fill(source, flat, plan.entries)
        if flat.is_cuda:
            torch.cuda.synchronize(device)  # the bytes are in place before any handle leaves
    except BaseException:
        if give_back is not None:
            give_back()
        raise
    return StagedBucket(plan, flat, give_back)


def fill(source, flat: torch.Tensor, entries: tuple[Entry, ...]) -> None:
    """Each entry's tensor into its place in `flat`: read straight from the file where it needs
    no conversion (a checkpoint's tensors on the sink's read threads, largest first, as the
    server reads a checkpoint itself: pread releases the GIL), else fetched and copied."""

    def view(e: Entry) -> torch.Tensor:
        return flat[e.start : e.start + e.nbytes].view(e.dtype).view(e.shape)

    def read(e: Entry) -> bool:
        return source.read_into(e.name, view(e))

    if isinstance(source, Checkpoint) and flat.device.type == "cpu" and len(entries) > 1:
        order = sorted(entries, key=lambda e: e.nbytes, reverse=True)
        with ThreadPoolExecutor(min(apply.read_workers(), MAX_READERS)) as pool:
            read_ok = list(pool.map(read, order))
        left = [e for e, ok in zip(order, read_ok, strict=True) if not ok]
    else:
        left = [e for e in entries if not read(e)]
    for e in left:
        copy_into(view(e), source.fetch(e.name))  # cast and device move in one copy


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src on one thread: memcpy for same-dtype contiguous CPU tensors, a cast in pieces
    below torch's parallel grain size otherwise. A two-thread OpenMP copy on cores a trainer and
    a server share spins waiting for a descheduled thread (176 ms of a 14.7 MB sync measured)."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)  # a device copy: no host threads
        return
    if src.shape != dst.shape:
        src = src.expand(dst.shape)
    if src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous():
        if dst.numel():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        return
    if not dst.is_contiguous():
        dst.copy_(src)  # staging buffers are contiguous; this is for other callers
        return
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    for start in range(0, flat_dst.numel(), SERIAL_ELEMENTS):
        end = start + SERIAL_ELEMENTS
        flat_dst[start:end].copy_(flat_src[start:end])
