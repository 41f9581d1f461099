"""Receiving in the tensor wire format: one payload entry -> validated (name, tensor) pairs.

Unpickling goes through grctl.weights.wire.unpickler, which calls nothing outside an exact
allowlist, and every bucket record and decoded tensor is validated before a view is built.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gc
import math
import pickle
import threading
from collections.abc import Iterator, Mapping

import torch

from grctl.errors import GrctlError, WeightValidationError
from grctl.model.dtypes import DTYPES
from grctl.weights.wire.describe import describe
from grctl.weights.wire.rebuilds import check_extent
from grctl.weights.wire.records import LocalSerializedTensor, metadata_fault
from grctl.weights.wire.unpickler import safe_loads

LOAD_FORMATS = ("flattened_bucket", "direct", None)
_ALLOWED_DTYPES = frozenset(DTYPES.values())


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a payload is decoded. A large one allocates enough
    objects to start a full collection, which walks the whole server heap holding the GIL
    (0.3 s and more, when /health must answer in 0.1). A scanned stream builds no cycles, so
    reference counting frees all of it when decoding ends; other threads' cycles wait for the
    next collection."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def deserialize(data: str | bytes) -> object:
    """A payload entry (base64 text or bytes, or a raw pickle) unpickled through the allowlist."""
    with _cyclic_gc_paused():
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
                f"flattened_bucket tensors {describe(last_name)} and {describe(name)} overlap at "
                f"offset {start}"
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
        who = f"tensor {describe(name)}" if isinstance(name, str) else f"record {index}"
        raise WeightValidationError(f"flattened_bucket {who}: {fault}")

    def refuse(what: str) -> WeightValidationError:
        return WeightValidationError(f"flattened_bucket tensor {describe(name)}: {what}")

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
            raise WeightValidationError(f"payload item {index}: name {describe(name)} is not a str")
        if isinstance(tensor, LocalSerializedTensor):
            inner = deserialize(tensor.entry(0))
            tensor = _checked_tensor(inner, "LocalSerializedTensor entry 0")
        out.append((name, _checked_tensor(tensor, f"tensor {describe(name)}")))
    return out


# What the unpickled objects may raise in decoding: the sender's mistake, a 400, never a 500.
_PAYLOAD_FAULTS = (RuntimeError, TypeError, ValueError, OverflowError, LookupError, AttributeError)


def decode_payload(entry: str | bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One serialized_named_tensors entry -> validated (name, tensor) pairs."""
    if load_format not in LOAD_FORMATS:
        raise WeightValidationError(
            f"load_format {describe(load_format)} is not supported; use flattened_bucket, "
            "direct or null"
        )
    decode = decode_bucket if load_format == "flattened_bucket" else decode_named_tensors
    with _cyclic_gc_paused():  # until the objects the payload made are gone again
        try:
            return decode(deserialize(entry))
        except GrctlError as exc:
            error = exc
        except _PAYLOAD_FAULTS as exc:
            msg = f"tensor payload refused: {type(exc).__name__}: {str(exc)[:300]}"
            error = WeightValidationError(msg)
        # The traceback's frames (the unpickler's among them) hold the payload's objects.
        error.__traceback__ = error.__context__ = error.__cause__ = None
    raise error
