"""The staging buffers: flat uint8 buffers in named POSIX shared memory (or on a GPU), made once
per process, pre-faulted, and reused by every push.

Fresh shared memory costs a page fault and a zeroed page per 4 KiB on first write (about
262,144 faults per GiB: the first push into fresh pages ran 3.6x slower than one into touched
pages). So a buffer is allocated once (torch reserves a new segment's pages with fallocate),
its page tables filled with MADV_POPULATE_WRITE where the kernel has it (zero_() where it does
not), then kept for the process's later pushes: a
trainer that syncs every step pays for its buffers once. Only one push at a time uses the kept
buffers; a concurrent one gets buffers of its own, dropped when it ends. `release()` gives the
kept buffers back (their segments leave /dev/shm once no server maps them).
"""

from __future__ import annotations

import atexit
import ctypes
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from grctl.errors import GrctlError
from grctl.weights.wire import encode

MiB = 1 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE = 4096


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


def shared_buffer(nbytes: int, prefault: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor allocated in named POSIX shared memory (no copy into it later);
    `prefault`: its pages reserved and mapped now (else the first write faults each in)."""
    encode.start_shm_manager_detached()
    new = getattr(torch.UntypedStorage, "_new_using_filename_cpu", None)
    try:
        if new is None:  # an older torch: allocate, then move into shared memory once
            flat = encode.share_for_ipc(torch.empty(nbytes, dtype=torch.uint8))
        else:
            flat = torch.empty(0, dtype=torch.uint8).set_(new(nbytes))
        if prefault:
            _prefault(flat)
        return flat
    except RuntimeError as exc:
        if "No space left" not in str(exc):
            raise
        raise no_shm_space(nbytes) from exc


def _prefault(flat: torch.Tensor) -> None:
    """Map every page now. torch already reserved them (it fallocates a new segment, about
    twice as fast as writing zeros through the mapping); what is left is filling the page
    tables, so that no later write faults."""
    if flat.numel() and not _populate(flat.data_ptr(), flat.numel()):
        flat.zero_()


def _populate(address: int, nbytes: int) -> bool:
    """Fill the page tables of [address, address + nbytes) for writing, without a write."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None:
        return False
    start = address & ~(_PAGE - 1)
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes + address - start),
                   _MADV_POPULATE_WRITE) == 0  # fmt: skip


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _LIBC = False
    return _LIBC or None


_LIBC = None


class BufferPool:
    """`count` flat buffers of `nbytes` on `device`, made and pre-faulted at once. A buffer
    comes back only when its bucket is freed, after every call carrying it returned (the
    protocol lets the client reuse its memory only after the server's reply)."""

    def __init__(self, nbytes: int, device: torch.device, count: int = 2):
        self.nbytes, self.device, self.count = nbytes, device, count
        self._free: list[torch.Tensor] = []
        for _ in range(count):
            if device.type == "cpu":
                flat = shared_buffer(nbytes, prefault=True)
            else:
                flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._free.append(flat)

    def fits(self, nbytes: int, device: torch.device, count: int) -> bool:
        return self.device == device and self.nbytes >= nbytes and self.count >= count

    def take(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A buffer's first `nbytes` bytes and the call that gives the buffer back."""
        flat = self._free.pop()
        return flat[:nbytes], lambda: self._free.append(flat)


_kept: dict[str, BufferPool] = {}  # device type -> this process's pool
_busy: set[str] = set()
_lock = threading.Lock()


@contextmanager
def pool_for(nbytes: int, device: torch.device, count: int = 2) -> Iterator[BufferPool]:
    """This process's kept pool for `device`, grown to `nbytes` x `count` if smaller; a pool
    of the push's own while another push holds the kept one."""
    key = str(device)
    with _lock:
        mine = key not in _busy
        if mine:
            _busy.add(key)
    try:
        if not mine:
            yield BufferPool(nbytes, device, count)
            return
        pool = _kept.get(key)
        if pool is None or not pool.fits(nbytes, device, count):
            _kept.pop(key, None)  # the old buffers go before the new ones are made
            pool = _kept[key] = BufferPool(nbytes, device, count)
        yield pool
    finally:
        if mine:
            with _lock:
                _busy.discard(key)
                kept = _kept.get(key)
                if kept is not None and len(kept._free) < kept.count:
                    del _kept[key]  # a call still reads one of its buffers: never reuse it


def release() -> None:
    """Drop the buffers kept for later pushes (a push holding them keeps them until it ends)."""
    with _lock:
        for key in [k for k in _kept if k not in _busy]:
            del _kept[key]


# At exit, not at interpreter teardown (which may never free them): a server that mapped one
# keeps the sender's shm manager alive, so a segment still referenced here would stay in
# /dev/shm until that server exits.
atexit.register(release)
