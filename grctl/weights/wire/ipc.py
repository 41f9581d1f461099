"""The tensor wire format of SGLang's update_weights_from_tensor, for sending and receiving.

A payload entry is base64 of a ForkingPickler stream. CUDA tensors travel as IPC handles whose
device field is the GPU's UUID (Ray and friends number the same GPU differently per process);
CPU tensors travel through POSIX shared memory (torch's file_system strategy), so no tensor
bytes cross HTTP. Receiving goes through `grctl.weights.wire.unpickler`, which calls nothing outside
an exact allowlist, and every record is validated before a view is built.

Lifetimes: a sender keeps its tensors (and its process) alive until the receiver has replied,
then drops them; the receiver drops every decoded tensor once applied. Then a CPU segment's
reference count reaches zero and it leaves /dev/shm. (torch keeps the receiver connected to each
sender's torch_shm_manager, so one idle manager process per sender lives as long as the server.)
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import math
import os
import pickle
import sys
import threading
from collections.abc import Iterable, Mapping
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

from grctl.errors import GrctlError, WeightValidationError
from grctl.model.dtypes import DTYPES
from grctl.weights.wire.records import (
    FlattenedTensorMetadata,
    LocalSerializedTensor,
    metadata_fault,
)
from grctl.weights.wire.unpickler import CUDA_DEVICE_ARG, check_extent, cuda_device_uuid, safe_loads

LOAD_FORMATS = ("flattened_bucket", "direct", None)
_REF_COUNTER_ARGS = slice(11, 13)  # ref_counter_handle, ref_counter_offset in a CUDA record
_manager_lock = threading.Lock()
_manager_started = False
_ALLOWED_DTYPES = frozenset(DTYPES.values())


# ---- sending -------------------------------------------------------------------------------


class Shares:
    """What one serialization lends its receiver, for a sender to take back when the receiver
    never rebuilds the payload (or the segment, or block, stays pinned until the sender exits).

    segments: each CPU storage shared by name carries one extra reference that the receiver's
    rebuild consumes (`release_segments` drops it instead). counters: each CUDA share gets a
    reference counter (a slot in a shared-memory file) set to 1, which the receiver decrements
    when it lets the tensor go (client.devices.release_unclaimed reads and releases those)."""

    def __init__(self) -> None:
        self.segments: list[torch.UntypedStorage] = []
        self.counters: list[tuple[bytes, int]] = []

    def release_segments(self) -> None:
        for storage in self.segments:
            storage._shared_decref()
        self.segments = []


def _reduce_tensor(tensor: torch.Tensor, device_uuid: bool = True, shares: Shares | None = None):
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        if shares is not None:
            shares.counters.append(tuple(args[_REF_COUNTER_ARGS]))
        if device_uuid and type(args[CUDA_DEVICE_ARG]) is int:
            # The receiver may number this GPU differently (CUDA_VISIBLE_DEVICES): its UUID.
            uuid = cuda_device_uuid(args[CUDA_DEVICE_ARG])
            args = (*args[:CUDA_DEVICE_ARG], uuid, *args[CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


def start_shm_manager_detached() -> None:
    """Start torch's torch_shm_manager daemon with stdout and stderr on /dev/null.

    torch starts it on the first named shared-memory allocation, and it inherits our stdout and
    stderr. It outlives this process (the server stays connected to it), so whoever reads our
    output through a pipe (`grctl push | tee`, subprocess.run(capture_output=True)) would wait
    for an EOF that never comes. Once started, the daemon serves this process until it exits.
    """
    global _manager_started
    with _manager_lock:
        if _manager_started:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        saved, null = (os.dup(1), os.dup(2)), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 1)
            os.dup2(null, 2)
            torch.empty(1, dtype=torch.uint8).untyped_storage()._share_filename_cpu_()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, null):
                os.close(fd)
        _manager_started = True


def _reduce_storage_by_name(storage: torch.UntypedStorage, shares: Shares | None = None):
    # torch's file_system branch, whatever the process-wide sharing strategy: the receiver maps
    # the segment by name, where a file descriptor could not travel inside an HTTP body.
    if storage.device.type != "cpu":
        raise RuntimeError("only CPU storages are shared by name; send the tensor instead")
    start_shm_manager_detached()
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # keeps the segment alive if we drop it first; the receiver decrefs
    if shares is not None:
        shares.segments.append(storage)
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


class _IpcPickler(ForkingPickler):
    """ForkingPickler with grctl's reducers in its own dispatch table; torch stays unpatched."""

    def __init__(self, file: io.BytesIO, device_uuid: bool = True, shares: Shares | None = None):
        super().__init__(file)
        reduce = functools.partial(_reduce_tensor, device_uuid=device_uuid, shares=shares)
        for cls in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[cls] = reduce
        self.dispatch_table[torch.UntypedStorage] = functools.partial(
            _reduce_storage_by_name, shares=shares
        )


class MultiprocessingSerializer:
    @staticmethod
    def serialize(
        obj: object,
        output_str: bool = False,
        *,
        device_uuid: bool = True,
        shares: Shares | None = None,
    ) -> bytes | str:
        """A ForkingPickler stream of `obj` (standard base64 text with `output_str`); `shares`
        collects what it lends the receiver, for a sender to take back if it is never read."""
        buf = io.BytesIO()
        _IpcPickler(buf, device_uuid=device_uuid, shares=shares).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode("ascii") if output_str else data

    @staticmethod
    def deserialize(data: str | bytes) -> object:
        return safe_loads(_pickle_bytes(data))


def _pickle_bytes(data: object) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= pickle.HIGHEST_PROTOCOL:
            return data  # raw pickle, as SGLang's in-process callers send it
    elif not isinstance(data, str):
        raise WeightValidationError(f"a payload entry is a {type(data).__name__}, not base64")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise WeightValidationError(
            "a payload entry is not valid base64 (standard alphabet, padded, no whitespace)"
        ) from None


def share_for_ipc(tensor: torch.Tensor) -> torch.Tensor:
    """Move a CPU tensor's storage into shared memory now, in place (serializing does it too).

    CUDA tensors need nothing. Keep the tensor alive until the receiver has replied.
    """
    if tensor.device.type == "cpu":
        start_shm_manager_detached()
        tensor.untyped_storage()._share_filename_cpu_()
    return tensor


def encode_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]], keep_alive: list | None = None
) -> str:
    """One flattened_bucket payload entry; `keep_alive` (a list) receives the flat tensor."""
    bucket = FlattenedTensorBucket(named_tensors=named_tensors)
    if keep_alive is not None:
        keep_alive.append(bucket.get_flattened_tensor())
    return MultiprocessingSerializer.serialize(bucket.to_payload(), output_str=True)


def encode_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], keep_alive: list | None = None
) -> str:
    """A direct/null payload entry. CPU storages move into shared memory in place."""
    pairs = [(name, tensor.detach()) for name, tensor in named_tensors]
    if keep_alive is not None:
        keep_alive.extend(tensor for _, tensor in pairs)
    return MultiprocessingSerializer.serialize(pairs, output_str=True)


# ---- buckets -------------------------------------------------------------------------------


class FlattenedTensorBucket:
    """Tensors of any dtypes packed into one uint8 tensor; records carry byte offsets."""

    supports_multi_dtypes = True  # slime sends one bucket for all dtypes when this is set

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            self._flat, self._metadata = _flatten(named_tensors)
        elif flattened_tensor is not None and metadata is not None:
            self._flat, self._metadata = flattened_tensor, list(metadata)
        else:
            raise ValueError("pass named_tensors, or flattened_tensor and metadata")

    def get_flattened_tensor(self) -> torch.Tensor:
        return self._flat

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self._metadata

    def to_payload(self) -> dict:
        return {"flattened_tensor": self._flat, "metadata": self._metadata}

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return decode_bucket(self.to_payload())


def _flatten(named_tensors) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    flats, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        record = FlattenedTensorMetadata(
            name, tensor.shape, tensor.dtype, offset, offset + flat.numel(), flat.numel()
        )
        flats.append(flat)
        metadata.append(record)
        offset += flat.numel()
    if not flats:
        return torch.empty(0, dtype=torch.uint8), []
    if len({flat.device for flat in flats}) > 1:
        raise ValueError("a bucket's tensors must all be on one device")
    return torch.cat(flats), metadata


def decode_bucket(obj: object) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy (name, tensor) views of a bucket, after every record has been validated."""
    if not isinstance(obj, Mapping) or not {"flattened_tensor", "metadata"} <= obj.keys():
        raise WeightValidationError(
            "a flattened_bucket payload is a dict with flattened_tensor and metadata"
        )
    flat, records = obj["flattened_tensor"], obj["metadata"]
    _checked_tensor(flat, "flattened_tensor")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise WeightValidationError("flattened_tensor must be one contiguous dimension")
    if not isinstance(records, (list, tuple)):
        raise WeightValidationError("flattened_bucket metadata must be a list of records")
    spans = [_check_record(i, record, flat) for i, record in enumerate(records)]
    last_end, last_name = 0, None
    for name, _, _, start, end in sorted((s for s in spans if s[4] > s[3]), key=lambda s: s[3]):
        if start < last_end:
            raise WeightValidationError(
                f"flattened_bucket tensors {last_name!r} and {name!r} overlap at offset {start}"
            )
        last_end, last_name = end, name
    return [
        (name, _view(flat, start, end, dtype, shape)) for name, shape, dtype, start, end in spans
    ]


def _check_record(index: int, record: object, flat: torch.Tensor) -> tuple:
    name, shape, dtype, start, end, numel = (
        getattr(record, key, None)
        for key in ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
    )
    fault = metadata_fault(name, shape, dtype, start, end, numel)
    if fault is not None:
        who = f"tensor {name!r}" if isinstance(name, str) else f"record {index}"
        raise WeightValidationError(f"flattened_bucket {who}: {fault}")

    def refuse(what: str) -> WeightValidationError:
        return WeightValidationError(f"flattened_bucket tensor {name!r}: {what}")

    # uint8 flat tensor: byte offsets. Another dtype: an old one-dtype bucket, offsets in elements.
    in_bytes = flat.dtype == torch.uint8
    unit = "bytes" if in_bytes else f"{flat.dtype} elements"
    if not 0 <= start <= end <= flat.numel():
        raise refuse(f"[{start}, {end}) is outside the flattened tensor ({flat.numel()} {unit})")
    if end - start != numel:
        raise refuse(f"end_idx - start_idx is {end - start} but numel is {numel}")
    if not in_bytes and dtype != flat.dtype:
        raise refuse(f"is {dtype} inside an old-layout {flat.dtype} bucket")
    expected = math.prod(shape) * (dtype.itemsize if in_bytes else 1)
    if numel != expected:
        raise refuse(f"numel {numel} does not match shape {list(shape)} ({expected} {unit})")
    return name, tuple(shape), dtype, start, end


def _view(flat: torch.Tensor, start: int, end: int, dtype: torch.dtype, shape) -> torch.Tensor:
    part = flat[start:end]
    if part.dtype != dtype:
        try:
            part = part.view(dtype)
        except RuntimeError:  # offset not aligned to the dtype's size: one copy of this tensor
            part = part.clone().view(dtype)
    return part.reshape(shape)


# ---- receiving -----------------------------------------------------------------------------


def _checked_tensor(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise WeightValidationError(f"{what} is a {type(tensor).__name__}, not a tensor")
    if tensor.layout != torch.strided or tensor.dtype not in _ALLOWED_DTYPES:
        raise WeightValidationError(f"{what} is a {tensor.layout} {tensor.dtype} tensor")
    if tensor.requires_grad or getattr(tensor, "_backward_hooks", None):
        raise WeightValidationError(f"{what} carries autograd state")
    storage = tensor.untyped_storage()
    check_extent(
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.element_size(),
        storage.nbytes(),
        what,
    )
    return tensor


def decode_named_tensors(obj: object) -> list[tuple[str, torch.Tensor]]:
    """A direct/null payload: (name, tensor | LocalSerializedTensor) pairs, checked."""
    if not isinstance(obj, (list, tuple)):
        raise WeightValidationError("a direct/null payload is a list of (name, tensor) pairs")
    out = []
    for index, item in enumerate(obj):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise WeightValidationError(f"payload item {index} is not a (name, tensor) pair")
        name, tensor = item
        if not isinstance(name, str):
            raise WeightValidationError(f"payload item {index}: name {name!r:.60} is not a str")
        if isinstance(tensor, LocalSerializedTensor):
            inner = MultiprocessingSerializer.deserialize(tensor.entry(0))
            tensor = _checked_tensor(inner, "LocalSerializedTensor entry 0")
        out.append((name, _checked_tensor(tensor, f"tensor {name!r}")))
    return out


def decode_payload(entry: str | bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One serialized_named_tensors entry -> validated (name, tensor) pairs."""
    if load_format not in LOAD_FORMATS:
        raise WeightValidationError(
            f"load_format {load_format!r} is not supported; use flattened_bucket, direct or null"
        )
    obj = MultiprocessingSerializer.deserialize(entry)
    try:
        if load_format == "flattened_bucket":
            return decode_bucket(obj)
        return decode_named_tensors(obj)
    except GrctlError:
        raise
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        # Whatever the unpickled objects hold, the sender's mistake is a 400, never a 500.
        msg = f"tensor payload refused: {type(exc).__name__}: {exc}"
        raise WeightValidationError(msg[:400]) from None
