"""The one dtype table: names <-> torch dtypes, for every place a dtype crosses a boundary.

A dtype arrives as a name in config.json (`torch_dtype`), on the command line (`--dtype bf16`),
in a distributed update's `dtypes` list ("bfloat16" or "torch.bfloat16"), in a safetensors
header ("BF16"), as a `torch.<name>` global in a pushed pickle, and in a /weights_checker reply.
Everything here is derived from one list of torch names, so the places cannot disagree (the
names alone, without torch, are in dtype_names.py).
"""

from __future__ import annotations

import torch

from grctl.model.dtype_names import SERVED_DTYPE_NAMES, name_of

__all__ = ["DTYPES", "SAFETENSORS", "SERVED_DTYPES", "WEIGHT_DTYPES", "from_name", "name_of"]

# torch names, in the order safetensors' own names follow below (None: no safetensors name).
_NAMES = (
    ("float64", "F64"),
    ("float32", "F32"),
    ("float16", "F16"),
    ("bfloat16", "BF16"),
    ("int64", "I64"),
    ("int32", "I32"),
    ("int16", "I16"),
    ("int8", "I8"),
    ("uint8", "U8"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("bool", "BOOL"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("float4_e2m1fn_x2", None),  # safetensors' F4 counts elements, torch packs two a byte
    ("float8_e4m3fnuz", None),
    ("float8_e5m2fnuz", None),
    ("complex32", None),
    ("complex64", None),
    ("complex128", None),
)

# Every dtype grctl will name or accept, by torch name (a torch build without one drops it).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name, _ in _NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
SAFETENSORS: dict[str, torch.dtype] = {
    st: DTYPES[name] for name, st in _NAMES if st is not None and name in DTYPES
}
# What a parameter may be written from (the sink converts each to the parameter's dtype).
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# What the served model may be built in (--dtype and config.json's torch_dtype).
SERVED_DTYPES = {name: DTYPES[torch_name] for name, torch_name in SERVED_DTYPE_NAMES.items()}


def from_name(text: object) -> torch.dtype | None:
    """A torch name, with or without "torch." ("bfloat16", "torch.bfloat16"); None if unknown."""
    return DTYPES.get(str(text).removeprefix("torch.")) if text else None
