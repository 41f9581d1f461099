"""What a tensor push reads from: a checkpoint directory, or the tensors a trainer holds.

Both answer the same calls: `specs()`, every tensor's name, shape and dtype, known before any
server is paused (the plan needs them all); `fetch(name)`, the tensor; and `read_into(name,
dst)`, a read straight into a staging buffer where no conversion is needed (False: the caller
copies what `fetch` gives). `config` is the checkpoint's structure, None for tensors in memory
(the plan then uses the served structure alone).

`NamedTensors` holds the trainer's tensors by reference, CPU or CUDA: nothing is copied until a
bucket is staged, so they must not change until the push returns. An iterator is consumed
whole before the push starts, so every tensor it yields is alive at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from grctl.client import staging
from grctl.errors import ValidationError
from grctl.weights.apply import TensorSpec
from grctl.weights.checkpoint import Checkpoint


class NamedTensors:
    """(hf_name, tensor) pairs a trainer holds: a state dict, or any iterable of pairs."""

    config = None

    def __init__(self, named_tensors: Mapping[str, torch.Tensor] | Iterable):
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        self._tensors: dict[str, torch.Tensor] = {}
        for item in pairs:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValidationError(
                    f"a tensor push takes (hf_name, tensor) pairs or a state dict, not "
                    f"{type(item).__name__} items"
                )
            name, tensor = item
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise ValidationError(
                    f"({type(name).__name__}, {type(tensor).__name__}) is not an "
                    "(hf_name, tensor) pair"
                )
            if tensor.layout != torch.strided or tensor.is_meta:
                raise ValidationError(f"tensor {name!r} is not a dense tensor with data")
            if name in self._tensors:
                raise ValidationError(f"tensor {name!r} is given twice")
            self._tensors[name] = tensor.detach()
        self.label = f"{len(self._tensors)} tensors in memory"

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in self._tensors.items()]

    def fetch(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def read_into(self, name: str, dst: torch.Tensor) -> bool:
        return False

    def close(self) -> None:
        self._tensors.clear()


def is_path(source: object) -> bool:
    return isinstance(source, (str, os.PathLike))


def open_source(source) -> Checkpoint | NamedTensors:
    """A checkpoint directory (a path), or tensors (NamedTensors, a state dict, pairs)."""
    if is_path(source):
        return Checkpoint(Path(source))
    if isinstance(source, (Checkpoint, NamedTensors)) or is_source(source):
        return source
    return NamedTensors(source)


def is_source(source: object) -> bool:
    """Anything that answers a push's calls (specs, fetch, read_into), as grctl.rl's Arena."""
    return all(callable(getattr(source, n, None)) for n in ("specs", "fetch", "read_into"))


def plans_of(source, served: torch.dtype | None, budget_bytes: int, device: torch.device):
    """The buckets of `source` for a server of `served` dtype staged on `device`: the source's
    own layout where it has one (an arena's tensors are sent where they lie), else planned."""
    own = getattr(source, "plans", None)
    layout = own(served, budget_bytes, device) if callable(own) else None
    return (
        layout if layout is not None else staging.plan_buckets(source.specs(), served, budget_bytes)
    )


def label_of(source, opened) -> str:
    """What a SyncResult names as its checkpoint: the path, or how many tensors were pushed."""
    if is_path(source) or opened is None:
        return str(source)
    if isinstance(opened, Checkpoint):
        return str(opened.path)
    return getattr(opened, "label", type(opened).__name__)
