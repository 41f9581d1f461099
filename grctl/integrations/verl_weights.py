"""The trainer side of `rollout.name=grctl`: verl's BaseRollout adapter in each trainer worker.

verl's hybrid sync (checkpoint backend "naive", sync training) calls, on every trainer rank:
resume(["weights"]), update_weights(the HF-named tensors, global_steps=N), resume(["kv_cache"]),
and release() before it trains: the same sequence its SGLang adapter sends over HTTP. Here the
tensors go to the rank's grctl server as SGLang's flattened buckets
(GRClient.push_tensors: CUDA IPC on the server's GPU, shared memory for a CPU server),
labelled weight_version N, so every reply says which step's weights produced it.

verl's own checkpoint engines (nccl, nixl, ...) call the same update_weights in the rollout's
CheckpointEngineWorker, on the rollout's GPU, after pausing the replicas with abort; their
tensors come as an async generator of views into a reused buffer, so they are copied first
(the model's size in device memory, for the push).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

from grctl.client.http import GRClient
from grctl.integrations.verl_rollout import MISSING, server_url, settings

try:
    from verl.workers.rollout.base import BaseRollout
except ImportError:  # importable without verl (grctl.integrations.verl.replica_class says why)
    BaseRollout = object  # type: ignore[assignment,misc]


async def collect(weights: Any) -> list[tuple[str, Any]]:
    """verl's weights as (name, tensor) pairs: a trainer's generator of whole tensors as they
    are; a checkpoint engine's async generator, whose tensors are views of the bucket buffer it
    receives the next bucket into, copied as they come."""
    if hasattr(weights, "__aiter__"):
        return [(name, tensor.clone()) async for name, tensor in weights]
    return [(name, tensor) for name, tensor in weights]


class GrctlServerAdapter(BaseRollout):
    def __init__(
        self,
        config: Any,
        model_config: Any,
        device_mesh: Any = None,
        replica_rank: int = -1,
        **kwargs: Any,
    ):
        if MISSING is not None:
            raise ImportError(f"grctl's verl rollout needs verl: {MISSING}")
        super().__init__(config, model_config, device_mesh)
        # one server per device, so a trainer rank's replica is its rank (verl sets RANK)
        self.replica_rank = int(os.environ.get("RANK", "0")) if replica_rank < 0 else replica_rank
        self.is_leader_rank = True  # the replica's one rank (verl's checkpoint engines ask)
        self.url = server_url(self.config, self.replica_rank)
        self.client = GRClient(self.url, api_key=settings(self.config).get("api_key"))
        engine = getattr(self.config, "checkpoint_engine", None)
        self.bucket_mb = float(getattr(engine, "update_weights_bucket_megabytes", 512) or 512)

    async def resume(self, tags: list[str]) -> None:
        if self.config.free_cache_engine:
            await asyncio.to_thread(self.client.resume_memory_occupation, list(tags))

    async def release(self) -> None:
        if self.config.free_cache_engine:
            await asyncio.to_thread(self.client.release_memory_occupation, ["kv_cache", "weights"])

    async def update_weights(
        self,
        weights: Iterable[tuple[str, Any]],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(
                f"rollout.name=grctl takes whole tensors, not {wire_format!r}: turn verl's delta "
                "weight sync off"
            )
        if peft_config is not None:
            raise ValueError(
                "rollout.name=grctl serves merged weights: set actor_rollout_ref.model.lora.merge"
                "=True (a LoRA adapter is not served separately)"
            )
        named = await collect(weights)
        version = None if global_steps is None else str(global_steps)
        await asyncio.to_thread(
            self.client.push_tensors, named, bucket_mb=self.bucket_mb, weight_version=version
        )
