"""The reference count at the head of a mapped torch segment, moved out of the sender's reach.

torch maps a file_system segment as a 64-byte header (an int32 reference count) followed by the
data. When the storage is let go, torch decrements that count through its mapping (and unlinks
the file at zero). If the sender has truncated its segment to zero bytes by then, the decrement
touches a page past the file's end: SIGBUS, and the server is gone.

`detach` swaps the mapping's first page for a private copy of it. The decrement torch makes
later lands on that copy, at a count that never reaches zero. `give_back` then returns the
sender's lent reference through the file with pread and pwrite, as torch's decrement would:
a truncated file makes that a short read, never a signal. Both run while the sender waits for
the reply (it lets its own reference go after that), so the read-then-write meets no other
writer.

A SIGBUS is still possible inside torch's own rebuild, in the microseconds between torch
growing the file and its increment. That window is torch's; nothing in grctl can close it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

from grctl.weights.wire.segments import SHM_HEADER

PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10  # Linux's value on every architecture torch ships for
_PRIVATE_COUNT = 1 << 30  # torch's later decrement on the private copy never reaches zero
_COUNT = ctypes.sizeof(ctypes.c_int32)


def _libc_mmap():
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return fn


_mmap = _libc_mmap()


def detach(storage: torch.UntypedStorage, fd: int) -> bool:
    """Replace the first page of `storage`'s segment mapping with a private copy read from
    `fd` (bytes a truncated file no longer has read as zeros). False: left as torch mapped it
    (not Linux, or not a mapping that starts a page before its data)."""
    base = storage.data_ptr() - SHM_HEADER
    if _mmap is None or base <= 0 or base % PAGE:
        return False
    page = bytearray(PAGE)
    done = 0
    while done < PAGE:  # a short read: the file ends here, the rest stays zero
        n = os.preadv(fd, [memoryview(page)[done:]], done)
        if n <= 0:
            break
        done += n
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    got = _mmap(base, PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got != base:
        err = ctypes.get_errno()
        raise OSError(err, f"could not take the shared-memory header private: {os.strerror(err)}")
    ctypes.memmove(base, bytes(page), PAGE)
    ctypes.c_int32.from_address(base).value = _PRIVATE_COUNT
    return True


def give_back(fd: int, path: str) -> None:
    """The decrement torch would have made on letting the storage go, made through the file:
    one less on the count, and the segment unlinked at zero. A file too short to hold the
    count (truncated by its sender) is unlinked too: no process can let it go without a fault,
    so nothing else would."""
    raw = os.pread(fd, _COUNT, 0)
    count = int.from_bytes(raw, sys.byteorder, signed=True) - 1 if len(raw) == _COUNT else 0
    os.pwrite(fd, count.to_bytes(_COUNT, sys.byteorder, signed=True), 0)
    if count == 0:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
