"""Disk to GPU through two pinned host buffers, the file read of one tensor overlapping the
host-to-device copy of the one before (CUDA only).

A `copy_` from pageable host memory is synchronous and runs at a fraction of the link's speed;
from pinned memory it is a DMA the GPU runs on its own. Each tensor is read from the file (or
fetched and cast) into one pinned buffer, then copied to its parameter on a side stream while the
next tensor is read into the other buffer; a buffer is refilled only after the event recorded
behind its last copy has completed. The buffers, each as large as the largest tensor, are kept
for later updates of the same model (one pair per device).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

log = logging.getLogger("grctl.weights")

_stagers: dict[torch.device, PinnedStager] = {}
_lock = threading.Lock()


class PinnedStager:
    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.stream = torch.cuda.Stream(device)
        self.turn = 0

    @property
    def nbytes(self) -> int:
        return self.buffers[0].numel()

    def copy(
        self,
        name: str,
        dst: torch.Tensor,
        read_into: Callable[[str, torch.Tensor], bool],
        fetch: Callable[[str], torch.Tensor],
    ) -> None:
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()  # this buffer's previous copy to the GPU has ended
        nbytes = dst.numel() * dst.element_size()
        host = self.buffers[self.turn][:nbytes].view(dst.dtype).view(dst.shape)
        if not read_into(name, host):  # another dtype on disk: fetch, cast into pinned memory
            src = fetch(name)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"tensor {name!r} changed shape since validation")
            host.copy_(src)
        # the side stream must not start before the default stream's last use of `dst`
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[self.turn] = event
        self.turn ^= 1

    def finish(self) -> None:
        self.stream.synchronize()
        self.events = [None, None]


def stager_for(dsts: list[torch.Tensor]) -> PinnedStager | None:
    """The device's stager, grown to the largest of `dsts`; None when none is on CUDA."""
    cuda = [d for d in dsts if d.is_cuda]
    if not cuda:
        return None
    device = cuda[0].device
    nbytes = max(d.numel() * d.element_size() for d in cuda)
    with _lock:
        stager = _stagers.get(device)
        if stager is None or stager.nbytes < nbytes:
            _stagers.pop(device, None)
            try:
                stager = _stagers[device] = PinnedStager(nbytes, device)
            except RuntimeError:  # no pinned memory to be had: the plain synchronous copy
                log.exception("pinned staging buffers unavailable; disk loads copy unpinned")
                return None
        return stager
