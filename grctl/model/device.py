"""The engine's device, as seen from each thread that launches work on it.

torch keeps the current CUDA device per thread, and every new thread starts on device 0. Streams,
graph memory pools, `torch.cuda.synchronize()` and allocations without an explicit device all go
to the current device, so each thread that touches a model on `cuda:N` (the engine's worker, the
graph capture, a weight update's handler thread) binds itself to it first.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def bind_thread(device: torch.device | str) -> None:
    """Make `device` the calling thread's current CUDA device; a no-op for any other device."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for all queued work on each CUDA device in `devices` (not just the current one)."""
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)


def gpu_uuid(device: torch.device | str) -> str | None:
    """The GPU's UUID ("GPU-xxxxxxxx-..."), which names it the same under any
    CUDA_VISIBLE_DEVICES; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
