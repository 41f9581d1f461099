"""The safe unpickler for pushed weights: an exact allowlist of globals and validating rebuilds.

A weight payload is a ForkingPickler stream, and unpickling runs every callable the stream names.
So `find_class` resolves only the exact (module, name) pairs that legitimate senders emit (stock
torch, SGLang's patched reducer, grctl), each to an object grctl chose; nothing else is imported
or called, whatever the payload says. What is still callable is narrowed further by the
rebuild functions of grctl.weights.wire.rebuilds, which check their arguments:
- BUILD can still reach `Tensor.__setstate__` on a rebuilt tensor, so grctl.weights.wire.decode
  checks every decoded tensor again (strided, inside its storage, no autograd state).
- EXT opcodes are refused before loading: the C unpickler's extension cache would skip
  `find_class` for a code resolved once before in this process.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import pickletools

import torch

from grctl.errors import WeightValidationError
from grctl.model.dtypes import DTYPES
from grctl.weights.wire.rebuilds import (
    TENSOR,
    TYPED_STORAGE,
    UNTYPED_STORAGE,
    _check,
    _refuse,
    rebuild_cuda_tensor,
    rebuild_storage_filename,
    rebuild_tensor,
    rebuild_typed_storage,
)
from grctl.weights.wire.records import FlattenedTensorMetadata, LocalSerializedTensor

_REFUSED_OPCODES = {"EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"}

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
        (red, "rebuild_tensor"): rebuild_tensor,
        (red, "rebuild_typed_storage"): rebuild_typed_storage,
        (red, "rebuild_storage_filename"): rebuild_storage_filename,
        (red, "rebuild_cuda_tensor"): rebuild_cuda_tensor,
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor,
        ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor,
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


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        obj = _allowed().get((module, name))
        if obj is None:
            raise WeightValidationError(
                f"tensor payload refused: it names the global {f'{module}.{name}':.200}, "
                "which is not on grctl's allowlist",
                hint=_HINTS.get((module, name)),
            )
        return obj

    def persistent_load(self, pid: object) -> object:
        raise _refuse("persistent ids are not part of the wire format")


def safe_loads(data: bytes) -> object:
    """Unpickle `data` through the allowlist; any failure is a WeightValidationError."""
    try:
        for opcode, _arg, _pos in pickletools.genops(data):
            _check(opcode.name not in _REFUSED_OPCODES, f"pickle opcode {opcode.name}")
        return SafeUnpickler(io.BytesIO(data)).load()
    except WeightValidationError:
        raise
    except Exception as exc:  # a hostile stream can raise anything; none of it is ours
        msg = f"not a valid tensor pickle ({type(exc).__name__}: {exc})"
        raise WeightValidationError(msg[:400]) from None
