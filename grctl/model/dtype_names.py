"""The dtype names without torch: what `--dtype` accepts and how a dtype is named on the wire.

grctl/model/dtypes.py maps these names to torch dtypes; this half stays importable where torch
is not wanted (the CLI's flags, the HTTP client), so `grctl --version` and `grctl status` start
without loading torch.
"""

from __future__ import annotations

# What the served model may be built in (--dtype and config.json's torch_dtype): a name -> the
# torch name it stands for.
SERVED_DTYPE_NAMES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
}


def name_of(dtype: object) -> str:
    """torch.bfloat16 (or the text "torch.bfloat16") -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
