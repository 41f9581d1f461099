"""The distributed transport: weights broadcast by a trainer (rank 0) over torch.distributed.

An update is validated whole (names, dtypes, shapes against the live model) before this rank
joins any collective, so a refused request leaves the group's collective sequence intact.
Tensors are received into fresh buffers outside the engine's exclusive section: a trainer that
dies mid-broadcast fails the call (a dropped connection, or the receive timeout) with the live
weights unchanged. Only then does WeightUpdater copy them in.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from datetime import timedelta

import torch
import torch.distributed as dist

from grctl.errors import InternalError, ValidationError
from grctl.weights import apply
from grctl.weights.apply import TensorSpec
from grctl.weights.process_group import Group, GroupRegistry, timeout_s
from grctl.weights.updater import UpdateOutcome, WeightUpdater

LOAD_FORMATS = (None, "flattened_bucket")


def parse_dtype(text: str) -> torch.dtype:
    dtype = getattr(torch, str(text).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValidationError(
            f"unknown dtype {text!r}", hint="use a torch dtype name such as 'bfloat16' or 'float32'"
        )
    return dtype


def parse_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorSpec]:
    if not len(names) == len(dtypes) == len(shapes):
        counts = f"{len(names)}, {len(dtypes)} and {len(shapes)}"
        raise ValidationError(f"names, dtypes and shapes differ in length: {counts}")
    if len(set(names)) != len(names):
        raise ValidationError("names must not repeat within one update")
    for name, shape in zip(names, shapes, strict=True):
        if any(d < 0 for d in shape):
            raise ValidationError(f"tensor {name!r} has a negative dimension in {shape}")
    return [
        TensorSpec(n, tuple(s), parse_dtype(d))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]


def nbytes(spec: TensorSpec) -> int:
    return spec.dtype.itemsize * math.prod(spec.shape)


def byte_layout(specs: list[TensorSpec]) -> list[tuple[int, int]]:
    """FlattenedTensorBucket's layout: each tensor's bytes in order, no padding."""
    ends = list(itertools.accumulate(nbytes(s) for s in specs))
    return [(end - nbytes(s), end) for s, end in zip(specs, ends, strict=True)]


def split_bucket(flat: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    out = []
    for spec, (start, end) in zip(specs, byte_layout(specs), strict=True):
        chunk = flat[start:end]
        if start % spec.dtype.itemsize:  # a dtype view needs an aligned offset: copy this one
            chunk = chunk.clone()
        out.append(chunk.view(spec.dtype).reshape(spec.shape))
    return out


def receive(group: Group, specs: list[TensorSpec], load_format: str | None, device) -> list:
    """Post every receive in `specs` order (one flat uint8 one for a bucket), wait for all."""
    if not specs:
        return []
    if load_format == "flattened_bucket":
        flat = torch.empty(byte_layout(specs)[-1][1], dtype=torch.uint8, device=device)
        buffers, tensors = [flat], None
    else:
        buffers = tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]
    works = [dist.broadcast(b, src=0, group=group.pg, async_op=True) for b in buffers]
    for w in works:
        w.wait(timeout=timedelta(seconds=timeout_s()))
    return tensors if tensors is not None else split_bucket(flat, specs)


def update_from_distributed(
    updater: WeightUpdater,
    registry: GroupRegistry,
    group_name: str,
    specs: list[TensorSpec],
    *,
    load_format: str | None = None,
    weight_version: str | None = None,
    token_step: int | str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
) -> UpdateOutcome:
    if load_format not in LOAD_FORMATS:
        raise ValidationError(
            f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'"
        )
    group = registry.get(group_name)
    model = updater.model
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if sum(nbytes(s) for s in specs) > 2 * param_bytes:
        raise ValidationError("the update carries more than twice the served model's bytes")
    device = next(model.parameters()).device if group.backend == "nccl" else torch.device("cpu")
    received: dict[str, torch.Tensor] = {}

    def plan_then_receive() -> list[apply.Write]:
        writes = apply.plan(model, specs, require_full=False)  # refuses before joining
        try:
            tensors = receive(group, specs, load_format, device)
        except Exception as exc:
            # The collective sequence is broken: no later call could line up with the trainer.
            with contextlib.suppress(ValidationError):  # unless a destroy call came first
                registry.destroy(group_name, is_broken=True)
            raise InternalError(
                f"broadcast receive in group {group_name!r} failed: {exc}",
                hint="the live weights are unchanged; the group is destroyed, so create a new "
                "one and send the update again",
            ) from exc
        received.update(zip((s.name for s in specs), tensors, strict=True))
        return writes

    return updater.run(
        plan_then_receive,
        received.pop,
        weight_version=weight_version,
        token_step=token_step,
        flush_cache=flush_cache,
        abort_all_requests=abort_all_requests,
    )
