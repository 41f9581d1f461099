"""The distributed transport: weights broadcast by a trainer (rank 0) over torch.distributed.

The trainer broadcasts as it posts the call, whatever the answer will be. So an update the
model refuses (an unknown name, a shape that does not fit, the weights released, requests in
flight) still receives the broadcast, into scratch, and then answers the refusal, as SGLang
does: the trainer's collective completes and the group's sequence stays in step. Only a call
whose broadcast cannot be known (dtypes, shapes or load_format unreadable, no such group, more
than twice the model's bytes) is refused without receiving. Tensors are
received into fresh buffers outside the engine's exclusive section, and the call waits until
the transfer has completed (polled against GR_DIST_TIMEOUT_S): a trainer that dies or stalls
mid-broadcast, or never sends, fails the call with the live weights unchanged. Only then does
WeightUpdater copy them in.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time

import torch
import torch.distributed as dist

from grctl.errors import InternalError, ValidationError
from grctl.model import dtypes
from grctl.weights import apply
from grctl.weights.apply import TensorSpec
from grctl.weights.process_group import Group, GroupRegistry, timeout_s
from grctl.weights.updater import UpdateOutcome, WeightUpdater

LOAD_FORMATS = (None, "flattened_bucket")


def parse_dtype(text: str) -> torch.dtype:
    dtype = dtypes.from_name(text)
    if dtype is None:
        raise ValidationError(
            f"unknown dtype {text!r}", hint="use a torch dtype name such as 'bfloat16' or 'float32'"
        )
    return dtype


def parse_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorSpec]:
    if not len(names) == len(dtypes) == len(shapes):
        counts = f"{len(names)}, {len(dtypes)} and {len(shapes)}"
        raise ValidationError(f"names, dtypes and shapes differ in length: {counts}")
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


def wait_all(works: list, timeout: float) -> None:
    """Return once every collective in `works` has finished, or raise TimeoutError at the deadline.

    NCCL's `Work.wait()` does not wait for the transfer: it only makes the current stream wait
    for it and returns at once, so the copy into the live weights would queue behind the whole
    broadcast inside the exclusive section, and a trainer dying mid-way would leave a partial
    buffer reported as received. `is_completed()` is true only once the collective is over (or
    failed) on every backend; `wait()` afterwards raises the collective's error if it had one.
    """
    deadline = time.monotonic() + timeout
    pause = 0.0002
    while not all(w.is_completed() for w in works):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broadcast did not complete within {timeout:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    for w in works:
        w.wait()


def receive(group: Group, specs: list[TensorSpec], load_format: str | None, device) -> list:
    """Post every receive in `specs` order (one flat uint8 one for a bucket); return once all
    of them have arrived (see wait_all), before the caller enters the exclusive section."""
    if not specs:
        return []
    if load_format == "flattened_bucket":
        flat = torch.empty(byte_layout(specs)[-1][1], dtype=torch.uint8, device=device)
        buffers, tensors = [flat], None
    else:
        buffers = tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]
    works = [dist.broadcast(b, src=0, group=group.pg, async_op=True) for b in buffers]
    wait_all(works, timeout_s())
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
    catalog_path: str | None = None,  # the catalog of these weights, installed with them
    refusal: Exception | None = None,  # the route refused the update's options
) -> UpdateOutcome:
    if load_format not in LOAD_FORMATS:
        raise ValidationError(
            f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'"
        )
    group = registry.get(group_name)
    model = updater.model
    if sum(nbytes(s) for s in specs) > 2 * updater.model_bytes:
        raise ValidationError("the update carries more than twice the served model's bytes")
    device = next(model.parameters()).device if group.backend == "nccl" else torch.device("cpu")
    received: dict[str, torch.Tensor] = {}
    owed = [True]  # this call's broadcast is still to be received

    def take_broadcast() -> list[torch.Tensor]:
        owed.clear()
        try:
            return receive(group, specs, load_format, device)
        except Exception as exc:
            # The collective sequence is broken: no later call could line up with the trainer.
            with contextlib.suppress(ValidationError):  # unless a destroy call came first
                registry.destroy(group_name, is_broken=True)
            raise InternalError(
                f"broadcast receive in group {group_name!r} failed: {exc}",
                hint="the live weights are unchanged; the group is destroyed, so create a new "
                "one and send the update again",
            ) from exc

    def plan_then_receive() -> list[apply.Write]:
        if refusal is not None:  # drained below (on_refusal), then raised as it is
            raise refusal
        names = [s.name for s in specs]
        if len(set(names)) != len(names):  # the entries' shapes still say what was sent
            raise ValidationError("names must not repeat within one update")
        writes = apply.plan(model, specs, require_full=False)
        received.update(zip((s.name for s in specs), take_broadcast(), strict=True))
        return writes

    def drain() -> None:
        """Refused before the receive: take the broadcast into scratch, then refuse."""
        if owed:
            take_broadcast()

    return updater.run(
        plan_then_receive,
        received.pop,
        weight_version=weight_version,
        token_step=token_step,
        flush_cache=flush_cache,
        abort_all_requests=abort_all_requests,
        on_refusal=drain,
        catalog_path=catalog_path,
    )
