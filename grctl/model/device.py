"""The model's device: what a --device value names, and that device as seen from each thread.

"auto" means where the model already is, when there is one (an engine handed a placed model),
else cuda when available, else cpu (a model about to be loaded).

torch keeps the current CUDA device per thread, and every new thread starts on device 0. Streams,
graph memory pools, `torch.cuda.synchronize()` and allocations without an explicit device all go
to the current device, so each thread that touches a model on `cuda:N` (the engine's worker, the
graph capture, a weight update's handler thread) binds itself to it first.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from grctl.errors import ValidationError


def resolve_device(name: str, placed: torch.device | None = None) -> torch.device:
    """A --device value as a torch.device, "cuda" with its index (the current CUDA device);
    `placed`: where the model already is, which "auto" keeps."""
    if name == "auto":
        cuda = torch.cuda.is_available()
        device = placed if placed is not None else torch.device("cuda" if cuda else "cpu")
    elif name.startswith("cuda") and not torch.cuda.is_available():
        raise ValidationError(f"device {name!r} asked for, but CUDA is not available")
    else:
        device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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
