"""A value a payload sent, described for an error message in a bounded number of characters,
whatever the value is (a repr could be gigabytes long, or take minutes)."""

from __future__ import annotations

import torch

_MAX_TEXT = 48
_MAX_ITEMS = 8
_MAX_LEN = 100


def describe(value: object) -> str:
    if value is None or type(value) in (bool, float):
        return repr(value)
    if type(value) is int:
        return repr(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"
    if type(value) in (str, bytes, bytearray):
        if len(value) <= _MAX_TEXT:
            return repr(value)
        return f"{repr(value[:_MAX_TEXT])[:-1]}... ({len(value)} long)"
    if isinstance(value, torch.dtype):
        return repr(value)
    if type(value) in (tuple, list, torch.Size):
        if len(value) <= _MAX_ITEMS and all(_is_scalar(item) for item in value):
            shown = ", ".join(describe(item) for item in value)
            if len(shown) <= _MAX_LEN:
                if type(value) is list:
                    return f"[{shown}]"
                return f"({shown},)" if len(value) == 1 else f"({shown})"
        return f"a {type(value).__name__} of {len(value)} items"
    if type(value) is dict:
        return f"a dict of {len(value)} items"
    return f"a {type(value).__name__}"


def _is_scalar(value: object) -> bool:
    return value is None or type(value) in (bool, int, float, str, bytes)
