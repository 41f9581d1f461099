"""The functions a weight payload may call, each checking its arguments before torch sees them.

They are what grctl.weights.wire.unpickler's allowlist hands out for torch's (and SGLang's)
rebuild functions. Tensor and storage classes resolve to inert tokens, so REDUCE/NEWOBJ on them
cannot allocate (`torch.Tensor(10**12)`); only these rebuild functions turn a token back into a
class. The one that opens memory, `rebuild_storage_filename`, maps an existing shared-memory
segment named `/torch_<pid>_<n>_<n>` through a torch_shm_manager socket. A hostile payload
could still name another process's torch segment, or a socket it planted under a
`torch-shm-dir-*` directory: that reads its bytes as weights and can unlink the segment's name
early (mappings stay valid), but runs nothing; one reason weight routes are off unless
--allow-weight-update.
"""

from __future__ import annotations

import os
import re
import stat

import torch
from torch.multiprocessing import reductions

from grctl.errors import WeightValidationError
from grctl.model.dtypes import DTYPES
from grctl.weights.wire.cuda import cuda_address_range, cuda_device_uuid

_NUM_CUDA_ARGS = 15  # torch's rebuild_cuda_tensor arguments (wire.cuda.CUDA_DEVICE_ARG: the device)
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
_SHM_MANAGER = re.compile(r"/(?:.+/)?torch-shm-dir-\w+/manager\.sock")
# torch maps a named segment as this header (its reference count) plus the data, and grows a
# file shorter than that to fit: the size a payload names must fit beside the header.
_SHM_HEADER = 64
# A CUDA sender's reference counters: one shared file of this many int64 slots, where the
# receiver adds one at `ref_counter_offset` (torch's CUDA_IPC_REF_COUNTER_FILE_SIZE).
_REF_COUNTER_SLOTS = 10_000
_MAX_DIM = 2**63 - 1  # torch sizes are int64

_ALLOWED_DTYPES = frozenset(DTYPES.values())


class _ClassToken:
    """Stands for a tensor or storage class in the stream; not callable, holds no state."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<class token {self.name}>"


TENSOR = _ClassToken("torch.Tensor")
UNTYPED_STORAGE = _ClassToken("torch.storage.UntypedStorage")
TYPED_STORAGE = _ClassToken("torch.storage.TypedStorage")


def _refuse(what: str) -> WeightValidationError:
    return WeightValidationError(f"tensor payload refused: {what}")


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise _refuse(what)


def _is_int(x: object, low: int = 0) -> bool:
    return type(x) is int and low <= x <= _MAX_DIM


def _dims(x: object) -> tuple[int, ...] | None:
    if isinstance(x, (tuple, list)) and all(_is_int(d) for d in x):
        return tuple(x)
    return None


def check_extent(size, stride, offset, itemsize: int, nbytes: int, what: str) -> None:
    """The view (size, stride, offset) in elements of `itemsize` bytes fits in `nbytes`."""
    _check(_dims(size) is not None, f"{what}: size {size!r} is not a tuple of ints >= 0")
    _check(_dims(stride) is not None, f"{what}: stride {stride!r} is not a tuple of ints >= 0")
    _check(len(size) == len(stride), f"{what}: size and stride differ in length")
    _check(_is_int(offset), f"{what}: storage offset {offset!r} is not an int >= 0")
    extent = 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    end = (offset + extent) * itemsize if extent else 0
    _check(end <= nbytes, f"{what}: view ends at byte {end}, storage holds {nbytes}")


def cuda_device_index(device: int | str) -> int:
    """The local index of a device sent as an index or as a GPU UUID (SGLang's reducer)."""
    num_devices = torch.cuda.device_count()
    if _is_int(device):
        _check(device < num_devices, f"CUDA device {device} is not on this server")
        return device
    _check(isinstance(device, str), f"CUDA device field {device!r:.80} is not an int or UUID")
    for index in range(num_devices):
        if cuda_device_uuid(index) == device:
            return index
    raise _refuse(f"no GPU on this server has UUID {device!r:.80}; CUDA IPC needs the same GPU")


def rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    """A CPU storage in POSIX shared memory (torch's file_system sharing strategy)."""
    _check(cls is UNTYPED_STORAGE and dtype is None, "shared CPU storage must be untyped")
    _check(type(handle) is bytes and _SHM_NAME.fullmatch(handle) is not None,
           f"shared-memory name {handle!r:.80} is not a torch segment")  # fmt: skip
    _check(_is_int(size), f"shared-memory size {size!r:.40} is not an int >= 0")
    _check(type(manager) is bytes, "torch_shm_manager socket path is not bytes")
    real = os.path.realpath(os.fsdecode(manager))
    _check(_SHM_MANAGER.fullmatch(real) is not None,
           f"{manager!r:.120} is not a torch_shm_manager socket path")  # fmt: skip
    try:
        _check(stat.S_ISSOCK(os.stat(real).st_mode), f"{real} is not a socket")
    except OSError as exc:
        raise _refuse(f"torch_shm_manager socket is gone ({exc.strerror}): {real}") from None
    _check_segment(handle, _SHM_HEADER + size, "shared-memory")
    return reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)


def _check_segment(handle: bytes, nbytes: int, what: str) -> None:
    """`handle` names an existing torch segment of at least `nbytes` bytes, header included."""
    if not os.path.isdir("/dev/shm"):
        return  # no tmpfs to look at (not Linux): torch's own checks are all there is
    try:
        seg = os.lstat("/dev/shm" + os.fsdecode(handle))
    except OSError as exc:
        raise _refuse(
            f"{what} segment {handle!r} is not in this server's /dev/shm ({exc.strerror}):"
            " the pushing process must run on this host and share its /dev/shm (a container"
            " needs the host's /dev/shm mounted) and keep the bucket until the call returns;"
            " otherwise push with --transport disk"
        ) from None
    _check(stat.S_ISREG(seg.st_mode), f"{handle!r} is not a regular segment")
    _check(
        seg.st_size >= nbytes,
        f"{what} segment {handle!r} is smaller than {nbytes} bytes ({seg.st_size})",
    )


def rebuild_typed_storage(storage, dtype):
    _check(type(storage) is torch.UntypedStorage, "typed storage must wrap an untyped storage")
    _check(dtype in _ALLOWED_DTYPES, f"dtype {dtype!r:.40} is not allowed")
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def rebuild_tensor(cls, storage, metadata):
    """A CPU tensor over a shared storage; always a plain tensor without autograd state."""
    _check(cls is TENSOR, f"tensor class {cls!r:.60} is not allowed")
    _check(type(storage) is torch.storage.TypedStorage, "tensor storage must be a typed storage")
    _check(isinstance(metadata, tuple) and len(metadata) == 4, "tensor metadata is malformed")
    offset, size, stride, _requires_grad = metadata
    untyped = storage._untyped_storage  # .untyped() warns that TypedStorage is deprecated
    check_extent(size, stride, offset, storage.dtype.itemsize, untyped.nbytes(), "CPU tensor")
    return torch.empty(0, dtype=storage.dtype).set_(untyped, offset, size, stride)


def rebuild_cuda_tensor(*args):
    """torch's CUDA IPC rebuild, with the device given as an index or a GPU UUID."""
    _check(len(args) == _NUM_CUDA_ARGS, f"CUDA tensor record has {len(args)} fields, not 15")
    cls, size, stride, offset, storage_cls, dtype, device, handle, nbytes, base = args[:10]
    _check(cls is TENSOR and storage_cls is TYPED_STORAGE, "CUDA tensor classes are not allowed")
    _check(dtype in _ALLOWED_DTYPES, f"dtype {dtype!r:.40} is not allowed")
    _check(_is_int(device) or isinstance(device, str), f"CUDA device {device!r:.80} malformed")
    _check(handle is None or type(handle) is bytes, "CUDA IPC handle is not bytes")
    _check(_is_int(nbytes) and _is_int(base), "CUDA storage size or offset is not an int >= 0")
    ref_handle, ref_offset, event_handle = args[11:14]
    _check(event_handle is None or type(event_handle) is bytes, "CUDA event handle malformed")
    _check(type(args[14]) is bool, "CUDA event_sync_required is not a bool")
    # torch adds one at slot `ref_offset` of the file `ref_handle` names: both must be inside it.
    is_segment = type(ref_handle) is bytes and (
        ref_handle == b"" or _SHM_NAME.fullmatch(ref_handle) is not None
    )
    _check(
        ref_handle is None or is_segment,
        f"CUDA ref-counter handle {ref_handle!r:.80} is not a torch segment",
    )
    _check(
        _is_int(ref_offset) and ref_offset < _REF_COUNTER_SLOTS,
        f"CUDA ref-counter offset {ref_offset!r:.40} is outside [0, {_REF_COUNTER_SLOTS})",
    )
    empty = handle is None or nbytes == 0
    check_extent(size, stride, offset, dtype.itemsize, 0 if empty else nbytes, "CUDA tensor")
    if not torch.cuda.is_available():
        # slime pads with 0-byte CUDA buckets: without a GPU they are empty CPU tensors.
        _check(empty, "CUDA IPC payload, but this server has no CUDA device")
        return torch.empty(size, dtype=dtype)
    index = cuda_device_index(device)
    if not empty and ref_handle:
        _check_segment(ref_handle, _SHM_HEADER + 8 * _REF_COUNTER_SLOTS, "CUDA ref-counter")
    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    fields = (torch.Tensor, size, stride, offset, torch.storage.TypedStorage, dtype, index)
    tensor = rebuild(*fields, handle, nbytes, base, False, *args[11:])
    if not empty:
        _check_cuda_block(tensor.untyped_storage(), nbytes)
    return tensor


def _check_cuda_block(storage: torch.UntypedStorage, nbytes: int) -> None:
    """The storage (block base + offset, nbytes) lies inside the CUDA IPC block it was opened
    from. torch maps the whole block, then trusts the sender's offset and size; nothing has
    read through the storage yet when this runs."""
    span = cuda_address_range(storage.data_ptr())
    if span is None:  # no driver API to ask: torch's own checks are all there is
        return
    start, length = span
    end = storage.data_ptr() + nbytes
    past = end - start - length
    _check(past <= 0, f"CUDA storage of {nbytes} bytes ends {past} bytes past its IPC block")
