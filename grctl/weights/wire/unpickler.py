"""The safe unpickler for pushed weights: an exact allowlist of globals and validating rebuilds.

A weight payload is a ForkingPickler stream, and unpickling runs every callable the stream names.
So before anything is built, grctl.weights.wire.scan runs the stream through a model of the
pickle machine: it bounds what the stream may build (opcodes, memo entries, nesting, how far
shared objects unfold), lets REDUCE call only allowlisted functions, NEWOBJ make only the wire
records and BUILD set state only on those (through their validating `__setstate__`), and refuses
extensions, persistent ids, sets and the protocol 0/1 object opcodes. Then `find_class` resolves
only the exact (module, name) pairs that legitimate senders emit (stock torch, SGLang's patched
reducer, grctl), each to an object grctl chose; nothing else is imported or called, whatever
the payload says. Functions are handed out wrapped and classes as tokens, neither of which takes
state, so BUILD on them fails here too. The functions are grctl.weights.wire.rebuilds', which
check their arguments; grctl.weights.wire.decode checks every decoded tensor again.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle

import torch

from grctl.errors import WeightValidationError
from grctl.model.dtypes import DTYPES
from grctl.weights.wire.describe import describe
from grctl.weights.wire.rebuilds import (
    TENSOR,
    TYPED_STORAGE,
    UNTYPED_STORAGE,
    rebuild_cuda_tensor,
    rebuild_storage_filename,
    rebuild_tensor,
    rebuild_typed_storage,
)
from grctl.weights.wire.records import FlattenedTensorMetadata, LocalSerializedTensor
from grctl.weights.wire.scan import check_stream
from grctl.weights.wire.segments import RefCounters


def _refuse(what: str) -> WeightValidationError:
    return WeightValidationError(f"tensor payload refused: {what}")


class _Allowed:
    """An allowlisted function as a payload reaches it: callable, with no state to set."""

    __slots__ = ("_fn",)

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *args):
        return self._fn(*args)

    def __setstate__(self, state: object) -> None:
        raise _refuse("BUILD on an allowlisted function")


_CUDA = _Allowed(rebuild_cuda_tensor)  # find_class hands each payload its own (ref counters)
_HINTS = {
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): (
        "CPU tensors must be shared with torch's file_system strategy; file descriptors cannot "
        "cross HTTP (grctl.weights.wire.encode.MultiprocessingSerializer does this for you)"
    ),
}


@functools.cache
def _allowed() -> dict[tuple[str, str], object]:
    red = "torch.multiprocessing.reductions"
    table: dict[tuple[str, str], object] = {
        ("torch", "Size"): torch.Size,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch", "Tensor"): TENSOR,
        ("torch.nn.parameter", "Parameter"): TENSOR,  # rebuilt as a plain tensor
        ("torch.storage", "UntypedStorage"): UNTYPED_STORAGE,
        ("torch.storage", "TypedStorage"): TYPED_STORAGE,
        (red, "rebuild_tensor"): _Allowed(rebuild_tensor),
        (red, "rebuild_typed_storage"): _Allowed(rebuild_typed_storage),
        (red, "rebuild_storage_filename"): _Allowed(rebuild_storage_filename),
        (red, "rebuild_cuda_tensor"): _CUDA,
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _CUDA,
        ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"): _CUDA,
    }
    table.update({("torch", name): dtype for name, dtype in DTYPES.items()})
    for module in (
        "grctl.weights.wire.records",
        "grctl.weights.wire_records",  # grctl before weights/wire/
        "grctl.weights.ipc",  # grctl before wire_records.py
        "sglang.srt.weight_sync.tensor_bucket",
        "sglang.srt.model_executor.model_runner",  # before tensor_bucket.py existed
    ):
        table[(module, "FlattenedTensorMetadata")] = FlattenedTensorMetadata
    for module in (
        "grctl.weights.wire.records",
        "grctl.weights.wire_records",  # grctl before weights/wire/
        "grctl.weights.ipc",  # grctl before wire_records.py
        "sglang.srt.model_executor.model_runner",  # verl via sglang.srt.weight_sync.utils
        "sglang.srt.model_executor.model_runner_components.weight_updater",  # SGLang >= 0.5.16
        "sglang.srt.model_executor.weight_updater",
    ):
        table[(module, "LocalSerializedTensor")] = LocalSerializedTensor
    return table


def resolve(module: str, name: str) -> object:
    """The object grctl chose for the global `module.name`; refused when it is not allowed."""
    obj = _allowed().get((module, name))
    if obj is None:
        raise WeightValidationError(
            f"tensor payload refused: it names the global {describe(f'{module}.{name}')}, "
            "which is not on grctl's allowlist",
            hint=_HINTS.get((module, name)),
        )
    return obj


class SafeUnpickler(pickle.Unpickler):
    """Loads one payload: the stream is scanned first (grctl.weights.wire.scan), then built."""

    def __init__(self, file: io.BufferedIOBase):
        self._data = file.read()
        super().__init__(io.BytesIO(self._data))
        ref_counters = RefCounters()
        self._cuda = _Allowed(functools.partial(rebuild_cuda_tensor, ref_counters=ref_counters))

    def find_class(self, module: str, name: str) -> object:
        obj = resolve(module, name)
        return self._cuda if obj is _CUDA else obj

    def persistent_load(self, pid: object) -> object:
        raise _refuse("persistent ids are not part of the wire format")

    def load(self) -> object:
        check_stream(self._data, resolve)
        return super().load()


def safe_loads(data: bytes) -> object:
    """Unpickle `data` through the scan and the allowlist; any failure is a
    WeightValidationError."""
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except WeightValidationError:
        raise
    except Exception as exc:  # a hostile stream can raise anything; none of it is ours
        msg = f"not a valid tensor pickle ({type(exc).__name__}: {str(exc)[:300]})"
        raise WeightValidationError(msg) from None
