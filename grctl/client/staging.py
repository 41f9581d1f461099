"""Tensor buckets for update_weights_from_tensor, staged on the server's device.

A plan is made from the checkpoint's headers alone (names, shapes, dtypes): tensors in
checkpoint order, a new bucket when the next tensor would pass the budget, and a tensor larger
than the budget alone in its own bucket (slime's rule). Staging a bucket reads its tensors
(lazily, through Checkpoint) straight into one flat uint8 buffer: POSIX shared memory for a CPU
server, device memory for a CUDA one, cast on the way to the served dtype, so the payload
carries one shared-memory name or one CUDA IPC handle per bucket and no tensor bytes cross HTTP.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass

import torch

from grctl.errors import GrctlError
from grctl.weights import ipc
from grctl.weights.apply import TensorSpec
from grctl.weights.checkpoint import Checkpoint

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
    ipc.start_shm_manager_detached()
    new = getattr(torch.UntypedStorage, "_new_using_filename_cpu", None)
    try:
        if new is None:  # an older torch: allocate, then move into shared memory once
            return ipc.share_for_ipc(torch.empty(nbytes, dtype=torch.uint8))
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


class StagedBucket:
    """One bucket's flat buffer and metadata. Alive until `free()`; the server reads it while a
    call that carries it is in flight, so free only after every such call has returned."""

    def __init__(self, plan: BucketPlan, flat: torch.Tensor):
        self.plan = plan
        self.flat: torch.Tensor | None = flat
        self.metadata = [
            ipc.FlattenedTensorMetadata(
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

    def payload_and_shares(self) -> tuple[str, ipc.Shares]:
        """The payload and what it lends the receiver (ipc.Shares), to take back if the
        receiver never rebuilds it."""
        assert self.flat is not None, "bucket already freed"
        bucket = ipc.FlattenedTensorBucket(flattened_tensor=self.flat, metadata=self.metadata)
        shares = ipc.Shares()
        payload = bucket.to_payload()
        text = ipc.MultiprocessingSerializer.serialize(payload, output_str=True, shares=shares)
        return text, shares

    def free(self) -> None:
        is_cuda = self.flat is not None and self.flat.is_cuda
        self.flat = None
        if is_cuda:
            torch.cuda.ipc_collect()  # release what the server has let go of (slime does this)


def release_unclaimed(shares: list[tuple[bytes, int]], release=None) -> int:
    """Release the CUDA IPC shares a server never rebuilt. Call only once the call that carried
    them is over on the server (a reply came, or the server is gone): the server holds no
    reference then, so a counter still at 1 means it refused the call before decoding the
    payload (401, 413, a malformed body...) and never will; left alone, the block would stay
    allocated in this process until it exits. Returns how many were released."""
    release = release or torch.UntypedStorage._release_ipc_counter_cuda  # what a receiver calls
    released = 0
    for handle, slot in shares:
        path = "/dev/shm/" + os.fsdecode(handle).lstrip("/")
        try:
            with open(path, "rb") as f:
                count = int.from_bytes(os.pread(f.fileno(), 8, 8 * slot), "little", signed=True)
        except OSError:  # the counter file is gone: torch has already let the block go
            continue
        if count > 0:
            release(handle, slot)
            released += 1
    return released


def check_cuda_ipc_allocator() -> None:
    """CUDA IPC cannot export memory from expandable segments (cudaIpcGetMemHandle refuses
    them): say so before staging, naming the setting, rather than fail inside torch."""
    from grctl.errors import ValidationError

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var, "")
        options = dict(o.split(":", 1) for o in conf.replace(" ", "").split(",") if ":" in o)
        if options.get("expandable_segments", "").lower() == "true":
            raise ValidationError(
                f"{var}={conf} enables expandable_segments in this process, and CUDA IPC "
                "cannot share memory from expandable segments",
                hint="push from a process without expandable_segments:True (unset it for "
                "`grctl push`), or use --transport disk",
            )


def stage(ckpt: Checkpoint, plan: BucketPlan, device: torch.device) -> StagedBucket:
    """Read the bucket's tensors from the checkpoint into one fresh flat buffer on `device`."""
    if device.type == "cpu":
        flat = shared_buffer(plan.nbytes)
    else:
        flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    for e in plan.entries:
        dst = flat[e.start : e.start + e.nbytes].view(e.dtype).view(e.shape)
        dst.copy_(ckpt.fetch(e.name))  # cast and device move in one copy
    if flat.is_cuda:
        torch.cuda.synchronize(device)  # the bytes are in place before any handle leaves
    return StagedBucket(plan, flat)


def _bare(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-")


def local_index(uuid: str, local_uuids: list[str]) -> int | None:
    """This process's index of the GPU named `uuid` (with or without nvidia-smi's "GPU-")."""
    wanted = _bare(uuid)
    return next((i for i, u in enumerate(local_uuids) if _bare(u) == wanted), None)


def stage_device(
    server_device: str, override: str | None = None, gpu_uuid: str | None = None
) -> torch.device:
    """Where to stage for a server on `server_device` ("cpu", "cuda:0"): CUDA IPC needs the same
    GPU. The server's index is its own (its CUDA_VISIBLE_DEVICES may differ from ours), so a
    server that reports its GPU's UUID is found by UUID; `override` wins over both."""
    from grctl.engine.device import gpu_uuid as uuid_of
    from grctl.errors import ValidationError

    dev = torch.device(override or server_device or "cpu")
    if dev.type == "cuda":
        check_cuda_ipc_allocator()
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValidationError(
            f"the server serves on {server_device}, but this process has no CUDA device",
            hint="run the push on the server's machine with its GPU visible, or use --transport "
            "disk",
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValidationError(f"cannot stage tensors for a server on {server_device!r}")
    if dev.type == "cuda" and gpu_uuid and not override:
        local = [uuid_of(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
        index = local_index(gpu_uuid, local)
        if index is None:
            raise ValidationError(
                f"the server's GPU {gpu_uuid} ({server_device} there) is not visible to this "
                f"process (it sees {', '.join(local) or 'none'})",
                hint="make that GPU visible here (CUDA_VISIBLE_DEVICES), or use --transport disk",
            )
        dev = torch.device("cuda", index)
    return dev
