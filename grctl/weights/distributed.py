"""The distributed transport: weights broadcast by a trainer (rank 0) over torch.distributed.

SGLang's group recipe, so trainers written for SGLang meet us: a TCP rendezvous whose store master
is rank 0, the store wrapped in PrefixStore(group_name), then a group of its own (not the default
group; a trainer that calls init_process_group gets a "default_pg" prefix and never meets us).

An update is validated whole before this rank joins any collective, so a refused request leaves
the group's collective sequence intact. Tensors are received into fresh buffers outside the
engine's exclusive section: a trainer that dies mid-broadcast fails the call (a dropped
connection, or the receive timeout) with the live weights unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from grctl.errors import Conflict, InternalError, ValidationError
from grctl.weights import apply
from grctl.weights.apply import TensorSpec
from grctl.weights.updater import UpdateOutcome, WeightUpdater

DEFAULT_TIMEOUT_S = 300.0
LOAD_FORMATS = (None, "flattened_bucket")


def timeout_s() -> float:
    """GR_DIST_TIMEOUT_S bounds the rendezvous, the group set-up and every receive."""
    value = float(os.environ.get("GR_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if value <= 0:
        raise ValidationError(f"GR_DIST_TIMEOUT_S must be positive, got {value}")
    return value


def create_group(
    backend: str, address: str, port: int, world_size: int, rank: int, name: str, timeout: float
) -> dist.ProcessGroup:
    """Join group `name` as `rank`; blocks until every rank has joined or `timeout` passes."""
    if backend == "nccl":
        # Default NCCL error handling tears the whole process down when a collective times out;
        # "2" aborts the communicator and raises in the waiting thread, so the server lives on.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    td = timedelta(seconds=timeout)
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=td)
    )
    store.set_timeout(td)
    store = c10d.PrefixStore(name, store)
    # Private, as in SGLang: the public new_group needs a default group, which we must not own.
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=name, timeout=td
    )
    # Ranks of this group are global ranks, so broadcast(src=0, group=pg) means the trainer.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: dist.ProcessGroup, backend: str, is_broken: bool = False) -> None:
    if is_broken and backend == "nccl":
        pg.abort()  # a half-finished NCCL collective would otherwise hang its stream
    dist.destroy_process_group(pg)


def check_init_args(
    model, address: str | None, port: int | None, rank: int | None, world: int | None, backend
) -> str:
    """Refuse a bad /init_weights_update_group before joining; returns the backend to use."""
    if not address or port is None or rank is None or world is None:
        raise ValidationError(
            "master_address, master_port, rank_offset and world_size are required"
        )
    if not 0 < port < 65536:
        raise ValidationError(f"master_port must be in 1..65535, got {port}")
    if not 0 < rank < world:
        raise ValidationError(
            f"rank_offset must be in 1..world_size-1 (rank 0 is the trainer); got rank_offset "
            f"{rank} with world_size {world}"
        )
    is_cuda = next(model.parameters()).is_cuda
    backend = backend or ("nccl" if is_cuda else "gloo")
    if backend not in ("nccl", "gloo") or (backend == "nccl" and not is_cuda):
        raise ValidationError(
            f"backend {backend!r} is not available here",
            hint="use 'nccl' for a model on CUDA, 'gloo' otherwise",
        )
    return backend


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


@dataclass
class Group:
    pg: dist.ProcessGroup | None  # None while its init call is still joining
    backend: str


class GroupRegistry:
    """The process groups of this server by name (torch keeps group names process-wide too)."""

    def __init__(self) -> None:
        self._groups: dict[str, Group] = {}
        self._lock = threading.Lock()

    def init(self, group_name: str, backend: str, address: str, port: int, rank: int, world: int):
        with self._lock:
            if group_name in self._groups:
                raise Conflict(
                    f"weight update group {group_name!r} already exists",
                    hint="destroy it first (/destroy_weights_update_group) or use another name",
                )
            self._groups[group_name] = group = Group(None, backend)
        try:
            group.pg = create_group(backend, address, port, world, rank, group_name, timeout_s())
        except Exception as exc:
            with self._lock:
                self._groups.pop(group_name, None)
            raise InternalError(
                f"could not join weight update group {group_name!r} at {address}:{port} as "
                f"rank {rank} of {world} ({backend}): {exc}",
                hint=f"the trainer must join as rank 0 within {timeout_s():g} s",
            ) from exc
        return group

    def get(self, group_name: str) -> Group:
        group = self._groups.get(group_name)
        if group is None or group.pg is None:
            state = "is still joining" if group else "does not exist"
            raise ValidationError(
                f"weight update group {group_name!r} {state}",
                hint="create it with /init_weights_update_group first",
            )
        return group

    def destroy(self, group_name: str, is_broken: bool = False) -> None:
        with self._lock:
            group = self.get(group_name)
            del self._groups[group_name]
        destroy_group(group.pg, group.backend, is_broken)


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
