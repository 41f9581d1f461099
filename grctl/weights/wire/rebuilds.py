"""The functions a weight payload may call, each checking its arguments before torch sees them.

They are what grctl.weights.wire.unpickler's allowlist hands out for torch's (and SGLang's)
rebuild functions. Each check builds its message only when it fails, and bounds it
(grctl.weights.wire.describe): a passing check formats nothing.
- Tensor and storage classes resolve to inert tokens that take no state, so REDUCE/NEWOBJ on
  them cannot allocate (`torch.Tensor(10**12)`) and BUILD cannot change them; only these
  rebuild functions turn a token back into a class.
- `rebuild_storage_filename` maps an existing shared-memory segment named `/torch_<pid>_<n>_<n>`
  through a torch_shm_manager socket. A hostile payload could still name another process's
  torch segment, or a socket it planted under a `torch-shm-dir-*` directory: that reads its
  bytes as weights and can unlink the segment's name early (mappings stay valid), but runs
  nothing; one reason weight routes are off unless --allow-weight-update.
- `rebuild_cuda_tensor` opens the sender's IPC block. The storage must end inside the block the
  handle opened (asked of the driver; refused when it cannot say), and the ref counter torch
  will decrement must be one of the sender's own counter files (grctl.weights.wire.segments).
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
from grctl.weights.wire.describe import describe
from grctl.weights.wire.segments import SHM_HEADER, RefCounters, check_segment, is_segment_name

_NUM_CUDA_ARGS = 15  # torch's rebuild_cuda_tensor arguments (wire.cuda.CUDA_DEVICE_ARG: the device)
_SHM_MANAGER = re.compile(r"/(?:.+/)?torch-shm-dir-\w+/manager\.sock")
# A CUDA sender's reference counters: one shared file of this many int64 slots, where the
# receiver subtracts one at `ref_counter_offset` (torch's CUDA_IPC_REF_COUNTER_FILE_SIZE).
_REF_COUNTER_SLOTS = 10_000
_MAX_DIM = 2**63 - 1  # torch sizes are int64

_ALLOWED_DTYPES = frozenset(DTYPES.values())


def _refuse(what: str) -> WeightValidationError:
    return WeightValidationError(f"tensor payload refused: {what}")


class _ClassToken:
    """Stands for a tensor or storage class in the stream; not callable, holds no state."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<class token {self.name}>"

    def __setstate__(self, state: object) -> None:
        raise _refuse(f"BUILD on the class {self.name}")


TENSOR = _ClassToken("torch.Tensor")
UNTYPED_STORAGE = _ClassToken("torch.storage.UntypedStorage")
TYPED_STORAGE = _ClassToken("torch.storage.TypedStorage")


def _shown(value: object) -> str:
    return repr(value) if isinstance(value, _ClassToken) else describe(value)


def _is_int(x: object, low: int = 0) -> bool:
    return type(x) is int and low <= x <= _MAX_DIM


def _dims(x: object) -> tuple[int, ...] | None:
    if isinstance(x, (tuple, list)) and all(_is_int(d) for d in x):
        return tuple(x)
    return None


def check_extent(size, stride, offset, itemsize: int, nbytes: int, what: str) -> None:
    """The view (size, stride, offset) in elements of `itemsize` bytes fits in `nbytes`."""
    if _dims(size) is None:
        raise _refuse(f"{what}: size {describe(size)} is not a tuple of ints >= 0")
    if _dims(stride) is None:
        raise _refuse(f"{what}: stride {describe(stride)} is not a tuple of ints >= 0")
    if len(size) != len(stride):
        raise _refuse(f"{what}: size and stride differ in length")
    if not _is_int(offset):
        raise _refuse(f"{what}: storage offset {describe(offset)} is not an int >= 0")
    extent = 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    end = (offset + extent) * itemsize if extent else 0
    if end > nbytes:
        raise _refuse(f"{what}: view ends at byte {end}, storage holds {nbytes}")


def cuda_device_index(device: int | str) -> int:
    """The local index of a device sent as an index or as a GPU UUID (SGLang's reducer)."""
    num_devices = torch.cuda.device_count()
    if _is_int(device):
        if device >= num_devices:
            raise _refuse(f"CUDA device {device} is not on this server")
        return device
    if not isinstance(device, str):
        raise _refuse(f"CUDA device field {describe(device)} is not an int or UUID")
    for index in range(num_devices):
        if cuda_device_uuid(index) == device:
            return index
    raise _refuse(f"no GPU on this server has UUID {describe(device)}; CUDA IPC needs the same GPU")


def rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    """A CPU storage in POSIX shared memory (torch's file_system sharing strategy)."""
    if cls is not UNTYPED_STORAGE or dtype is not None:
        raise _refuse("shared CPU storage must be untyped")
    if not is_segment_name(handle):
        raise _refuse(f"shared-memory name {describe(handle)} is not a torch segment")
    if not _is_int(size):
        raise _refuse(f"shared-memory size {describe(size)} is not an int >= 0")
    if type(manager) is not bytes:
        raise _refuse("torch_shm_manager socket path is not bytes")
    real = os.path.realpath(os.fsdecode(manager))
    if _SHM_MANAGER.fullmatch(real) is None:
        raise _refuse(f"{describe(manager)} is not a torch_shm_manager socket path")
    try:
        is_socket = stat.S_ISSOCK(os.stat(real).st_mode)
    except OSError as exc:
        raise _refuse(
            f"torch_shm_manager socket is gone ({exc.strerror}): {describe(real)}"
        ) from None
    if not is_socket:
        raise _refuse(f"{describe(real)} is not a socket")
    check_segment(handle, SHM_HEADER + size, "shared-memory")
    # a storage this process already holds (its own, when sender and server share a process)
    # comes from torch's cache: not a mapping of this rebuild's own
    cached = reductions.storage_from_cache(torch.UntypedStorage, handle) is not None
    storage = reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)
    try:
        storage._grctl_segment = handle  # its name, for reads that bypass the mapping
        if not cached:
            storage._grctl_mapped_here = True  # its header may be taken private (shm_header)
    except AttributeError:  # a torch whose storages take no attributes: read through the map
        pass
    return storage


def segment_of(tensor: torch.Tensor) -> bytes | None:
    """The name of the shared-memory segment a decoded CPU tensor lies in (None: not one a
    payload named, or a torch that does not keep the storage's Python object)."""
    if tensor.device.type != "cpu":
        return None
    return getattr(tensor.untyped_storage(), "_grctl_segment", None)


def rebuild_typed_storage(storage, dtype):
    if type(storage) is not torch.UntypedStorage:
        raise _refuse("typed storage must wrap an untyped storage")
    if not isinstance(dtype, torch.dtype) or dtype not in _ALLOWED_DTYPES:
        raise _refuse(f"dtype {describe(dtype)} is not allowed")
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def rebuild_tensor(cls, storage, metadata):
    """A CPU tensor over a shared storage; always a plain tensor without autograd state."""
    if cls is not TENSOR:
        raise _refuse(f"tensor class {_shown(cls)} is not allowed")
    if type(storage) is not torch.storage.TypedStorage:
        raise _refuse("tensor storage must be a typed storage")
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        raise _refuse("tensor metadata is malformed")
    offset, size, stride, _requires_grad = metadata
    untyped = storage._untyped_storage  # .untyped() warns that TypedStorage is deprecated
    check_extent(size, stride, offset, storage.dtype.itemsize, untyped.nbytes(), "CPU tensor")
    return torch.empty(0, dtype=storage.dtype).set_(untyped, offset, size, stride)


def rebuild_cuda_tensor(*args, ref_counters: RefCounters | None = None):
    """torch's CUDA IPC rebuild, with the device given as an index or a GPU UUID;
    `ref_counters` holds what the payload's earlier records named (a fresh one if None)."""
    if len(args) != _NUM_CUDA_ARGS:
        raise _refuse(f"CUDA tensor record has {len(args)} fields, not 15")
    cls, size, stride, offset, storage_cls, dtype, device, handle, nbytes, base = args[:10]
    if cls is not TENSOR or storage_cls is not TYPED_STORAGE:
        raise _refuse("CUDA tensor classes are not allowed")
    if not isinstance(dtype, torch.dtype) or dtype not in _ALLOWED_DTYPES:
        raise _refuse(f"dtype {describe(dtype)} is not allowed")
    if not (_is_int(device) or isinstance(device, str)):
        raise _refuse(f"CUDA device {describe(device)} malformed")
    if handle is not None and type(handle) is not bytes:
        raise _refuse("CUDA IPC handle is not bytes")
    if not (_is_int(nbytes) and _is_int(base)):
        raise _refuse("CUDA storage size or offset is not an int >= 0")
    ref_handle, ref_offset, event_handle = args[11:14]
    if event_handle is not None and type(event_handle) is not bytes:
        raise _refuse("CUDA event handle malformed")
    if type(args[14]) is not bool:
        raise _refuse("CUDA event_sync_required is not a bool")
    if not (ref_handle in (None, b"") or is_segment_name(ref_handle)):
        raise _refuse(f"CUDA ref-counter handle {describe(ref_handle)} is not a torch segment")
    if not (_is_int(ref_offset) and ref_offset < _REF_COUNTER_SLOTS):
        raise _refuse(
            f"CUDA ref-counter offset {describe(ref_offset)} is outside [0, {_REF_COUNTER_SLOTS})"
        )
    empty = handle is None or nbytes == 0
    check_extent(size, stride, offset, dtype.itemsize, 0 if empty else nbytes, "CUDA tensor")
    if not torch.cuda.is_available():
        # slime pads with 0-byte CUDA buckets: without a GPU they are empty CPU tensors.
        if not empty:
            raise _refuse("CUDA IPC payload, but this server has no CUDA device")
        return torch.empty(size, dtype=dtype)
    index = cuda_device_index(device)
    if not empty:
        # torch will subtract one from this slot when the tensor goes (a cached block: at once)
        (ref_counters or RefCounters()).claim(ref_handle, ref_offset)
    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    fields = (torch.Tensor, size, stride, offset, torch.storage.TypedStorage, dtype, index)
    tensor = rebuild(*fields, handle, nbytes, base, False, *args[11:])
    if not empty:
        check_ipc_block(tensor.untyped_storage(), base, index)
    return tensor


def check_ipc_block(storage, offset: int, device: int) -> None:
    """The storage torch built from an IPC record (block base + `offset`, its nbytes) lies
    inside the block the handle opened. torch maps the whole block, then trusts the sender's
    offset and size; nothing has read through the storage yet when this runs. Fails closed:
    if the driver cannot say how large the block is, the record is refused."""
    block = storage.data_ptr() - offset
    span = cuda_address_range(block, device)
    if span is None:
        raise _refuse(
            "cuMemGetAddressRange cannot say how large the CUDA IPC block is, so the storage's "
            "bounds cannot be checked"
        )
    start, length = span
    if start != block:
        raise _refuse("the CUDA IPC handle did not open at the start of a device allocation")
    past = offset + storage.nbytes() - length
    if past > 0:
        raise _refuse(
            f"CUDA storage of {storage.nbytes()} bytes at offset {offset} ends {past} bytes "
            f"past its IPC block ({length} bytes)"
        )
