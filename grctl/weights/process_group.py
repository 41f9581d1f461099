"""Process groups a trainer (rank 0) broadcasts weights over, made with SGLang's recipe.

Trainers written for SGLang meet us because both sides do the same: a TCP rendezvous whose store
master is rank 0, the store wrapped in PrefixStore(group_name), then a group of its own, not the
default group (a trainer that calls init_process_group gets a "default_pg" store prefix and never
meets us). Used by the server (GroupRegistry) and by the trainer side (grctl.client.distributed).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from grctl.errors import Conflict, InternalError, ValidationError

DEFAULT_TIMEOUT_S = 300.0


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
    if rank != 0:  # TCPStore's own connect retries overshoot its timeout (up to 3x seen)
        wait_for_listener(address, port, timeout)
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


def wait_for_listener(address: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rank 0 listens at {address}:{port}: {exc}") from exc
            time.sleep(0.05)


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

    def has(self, group_name: str) -> bool:
        return group_name in self._groups

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
