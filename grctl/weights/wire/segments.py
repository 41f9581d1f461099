"""torch's shared-memory segments as a payload names them: a CPU tensor's data, and a CUDA
sender's reference-counter file.

A CPU record maps a segment by name; it must exist in this server's /dev/shm and hold what the
record claims. A CUDA record names the file where torch, when the receiver lets the tensor go,
subtracts one from an int64 slot (at once, for a block already open): a payload could so
decrement an int64 inside any other torch segment. So a ref counter must be a file torch made
for that (exactly 64 + 8 * 10,000 bytes), never one of this server's own, all of one payload's
in one sender's files (the pid in the name), and each slot named once.
"""

from __future__ import annotations

import os
import re
import stat

from grctl.errors import WeightValidationError
from grctl.weights.wire.describe import describe

# torch maps a named segment as this header (its reference count) plus the data, and grows a
# file shorter than that to fit: the size a payload names must fit beside the header.
SHM_HEADER = 64
REF_COUNTER_FILE_BYTES = SHM_HEADER + 8 * 10_000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE slots
_SEGMENT_NAME = re.compile(rb"/torch_(\d+)_\d+_\d+")  # the pid of the process that made it


def _refuse(what: str) -> WeightValidationError:
    return WeightValidationError(f"tensor payload refused: {what}")


def is_segment_name(handle: object) -> bool:
    return type(handle) is bytes and _SEGMENT_NAME.fullmatch(handle) is not None


def _stat(handle: bytes, what: str) -> os.stat_result:
    try:
        seg = os.lstat("/dev/shm" + os.fsdecode(handle))
    except OSError as exc:
        raise _refuse(
            f"{what} segment {describe(handle)} is not in this server's /dev/shm"
            f" ({exc.strerror}): the pushing process must run on this host and share its"
            " /dev/shm (a container needs the host's /dev/shm mounted) and keep the bucket"
            " until the call returns; otherwise push with --transport disk"
        ) from None
    if not stat.S_ISREG(seg.st_mode):
        raise _refuse(f"{describe(handle)} is not a regular segment")
    return seg


def check_segment(handle: bytes, nbytes: int, what: str) -> None:
    """`handle` names an existing torch segment of at least `nbytes` bytes, header included."""
    if not os.path.isdir("/dev/shm"):
        return  # no tmpfs to look at (not Linux): torch's own checks are all there is
    size = _stat(handle, what).st_size
    if size < nbytes:
        raise _refuse(f"{what} segment {describe(handle)} is smaller than {nbytes} bytes ({size})")


class RefCounters:
    """The CUDA ref-counter slots one payload has named so far (one per opened block)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.slots: set[tuple[bytes, int]] = set()

    def claim(self, handle: object, slot: int) -> None:
        """`handle` and `slot` may be decremented for a block this payload opens: refused
        unless they are a slot, not named before, in a sender's own ref-counter file."""
        match = _SEGMENT_NAME.fullmatch(handle) if type(handle) is bytes else None
        if match is None:
            raise _refuse(f"CUDA ref-counter handle {describe(handle)} is not a torch segment name")
        pid = int(match[1])
        if pid == os.getpid():
            raise _refuse("the CUDA ref-counter handle names this server's own shared memory")
        if self.pid is not None and pid != self.pid:
            raise _refuse(
                "its CUDA ref counters are in files of two processes; a payload has one sender"
            )
        if (handle, slot) in self.slots:
            raise _refuse(f"it names CUDA ref-counter slot {slot} of {describe(handle)} twice")
        size = _stat(handle, "CUDA ref-counter").st_size
        if size != REF_COUNTER_FILE_BYTES:
            raise _refuse(
                f"{describe(handle)} is not a CUDA ref-counter file: torch makes those exactly "
                f"{REF_COUNTER_FILE_BYTES} bytes, it has {size}"
            )
        self.pid = pid
        self.slots.add((handle, slot))
