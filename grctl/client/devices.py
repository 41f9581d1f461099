"""Which local device a push stages on for each server, and CUDA IPC's limits on the client.

A server reports its device under its own CUDA_VISIBLE_DEVICES ("cuda:0" on every GPU of a
machine) and its GPU's UUID; the client finds that GPU among its own by UUID, so servers on
different GPUs each get buckets staged on their GPU. CUDA IPC cannot share memory from expandable
segments, and a share the server never rebuilt stays allocated here until released.
"""

from __future__ import annotations

import os

import torch

from grctl.errors import ValidationError


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
    from grctl.model.device import gpu_uuid as uuid_of

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
