"""The two records SGLang's tensor wire format pickles, as pure data.

`FlattenedTensorMetadata` locates one tensor inside a flattened bucket; `LocalSerializedTensor`
is verl's per-TP-rank wrapper. They live apart from encode.py and decode.py so that the unpickler's
allowlist names them without importing the code that sends and receives (no cycle),
and SGLang's class paths map onto them (grctl.weights.wire.unpickler).

A payload reaches a record through NEWOBJ + BUILD, so `__setstate__` is the entry point a sender
controls: it takes exactly the record's fields, each of the right type, and nothing else (an
injected `__setstate__` or extra attribute is refused). Bounds against the bucket's flat tensor
are checked where the bucket is decoded (decode.decode_bucket), since a record alone cannot know
them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from grctl.errors import WeightValidationError
from grctl.model.dtypes import DTYPES
from grctl.weights.wire.describe import describe

_ALLOWED_DTYPES = frozenset(DTYPES.values())
_MAX_DIM = 2**63 - 1  # torch sizes are int64


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes (current layout); elements in old one-dtype buckets

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict) or not set(state) <= METADATA_FIELDS:
            raise WeightValidationError("FlattenedTensorMetadata state has unexpected fields")
        fault = metadata_fault(*(state.get(key) for key in _FIELD_ORDER))
        if fault is not None:
            name = state.get("name")
            who = f"tensor {describe(name)}" if isinstance(name, str) else "record"
            raise WeightValidationError(f"flattened_bucket {who}: {fault}")
        for key in _FIELD_ORDER:
            setattr(self, key, state[key])


_FIELD_ORDER = tuple(f.name for f in fields(FlattenedTensorMetadata))
METADATA_FIELDS = frozenset(_FIELD_ORDER)


def metadata_fault(name, shape, dtype, start_idx, end_idx, numel) -> str | None:
    """What is wrong with a record's field types, or None; the same words wherever it is read."""
    if not isinstance(name, str):
        return f"name {describe(name)} is not a str"
    if not isinstance(shape, (tuple, list)) or not all(
        type(d) is int and 0 <= d <= _MAX_DIM for d in shape
    ):
        return f"shape {describe(shape)} is not a sequence of ints >= 0"
    if not isinstance(dtype, torch.dtype) or dtype not in _ALLOWED_DTYPES:
        return f"dtype {describe(dtype)} is not a torch dtype grctl accepts"
    for key, value in (("start_idx", start_idx), ("end_idx", end_idx), ("numel", numel)):
        if type(value) is not int:
            return f"{key} {describe(value)} is not an int"
        if not -_MAX_DIM <= value <= _MAX_DIM:
            return f"{key} {describe(value)} is out of range"
    return None


@dataclass
class LocalSerializedTensor:
    """verl's per-rank tensor: values[i] is TP rank i's own serialized tensor; grctl reads 0."""

    values: list[bytes]

    def __setstate__(self, state: object) -> None:
        values = state.get("values") if isinstance(state, dict) and len(state) == 1 else None
        _check_values(values)
        self.values = values

    def entry(self, rank: int = 0) -> bytes | str:
        """TP rank `rank`'s serialized tensor (decode it with decode.deserialize)."""
        values = getattr(self, "values", [])
        _check_values(values)
        if not 0 <= rank < len(values):
            raise WeightValidationError(f"LocalSerializedTensor has no entry for TP rank {rank}")
        return values[rank]


def _check_values(values: object) -> None:
    if not isinstance(values, list) or not all(isinstance(v, (bytes, str)) for v in values):
        raise WeightValidationError("LocalSerializedTensor.values is not a list of payloads")
