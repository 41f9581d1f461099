"""grctl's rollout for verl (`actor_rollout_ref.rollout.name=grctl`): the replica and its server
actor. verl builds them through the registry entry grctl.integrations.verl (the plugin) adds,
only once a process resolves the rollout by name: a verl process that never does imports none
of this.

The replica launches nothing: its server actor sends each generate, pause, resume and memory
call to the grctl server the config names for that replica (docs/rl-integration.md):

    actor_rollout_ref.rollout.name=grctl
    actor_rollout_ref.rollout.tensor_model_parallel_size=1      # one grctl server per device
    +actor_rollout_ref.rollout.custom.grctl.urls=[http://gpu-0:30001,http://gpu-1:30001]
    (or +actor_rollout_ref.rollout.custom.grctl.router=http://smg:30000, its workers in order)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

from grctl.client.http import AsyncGRClient
from grctl.client.router import worker_urls
from grctl.errors import GrctlError
from grctl.integrations.verl import NAME

try:
    import ray
    from verl.workers.rollout.replica import (
        RolloutMode,
        RolloutReplica,
        TokenOutput,
    )
except ImportError as exc:  # importable without verl; GrctlReplica's use says what is missing
    MISSING: ImportError | None = exc
    RolloutReplica = object  # type: ignore[assignment,misc]
else:
    MISSING = None

log = logging.getLogger("grctl.integrations.verl")
PAUSED_POLL_S = 0.2  # a request sent while paused waits for resume, as SGLang's does


def settings(rollout_config: Any) -> dict:
    """`rollout.custom.grctl`: urls (or url, or router), api_key, sampling_params (defaults
    merged under every request's), generate_timeout."""
    custom = getattr(rollout_config, "custom", None) or {}
    return dict(custom.get(NAME) or {})


def server_url(rollout_config: Any, replica_rank: int) -> str:
    """The grctl server replica `replica_rank` generates through."""
    cfg = rollout_config
    per_replica = (
        cfg.tensor_model_parallel_size * cfg.data_parallel_size * cfg.pipeline_model_parallel_size
    )
    if per_replica != 1:
        raise ValueError(
            f"rollout.name=grctl: a grctl server is one replica on one device, but the config "
            f"gives each replica {per_replica} (tensor, data and pipeline parallel sizes); set "
            "them to 1 and run one grctl server per device"
        )
    s = settings(cfg)
    urls = s.get("urls") or s.get("url")
    if not urls and s.get("router"):
        urls = worker_urls(str(s["router"]))
    urls = [urls] if isinstance(urls, str) else [str(u) for u in urls or ()]
    if replica_rank >= len(urls):
        raise ValueError(
            f"rollout.name=grctl: replica {replica_rank} has no server: "
            f"rollout.custom.grctl lists {len(urls)} (urls, url or router); verl runs one "
            "replica per device of the rollout (n_gpus_per_node x nnodes)"
        )
    return urls[replica_rank]


class GrctlServer:
    """The server actor of one replica (verl wraps it in ray.remote): every call is HTTP to a
    running grctl server."""

    def __init__(self, url: str, config: Any, replica_rank: int, rollout_mode: Any):
        s = settings(config)
        self.url, self.config, self.replica_rank = url, config, replica_rank
        self.rollout_mode = rollout_mode
        timeout = float(s.get("generate_timeout", 330.0))
        self.client = AsyncGRClient(url, api_key=s.get("api_key"), generate_timeout=timeout)
        self.defaults = dict(s.get("sampling_params") or {})
        self.global_steps: int | None = None
        self.reject_while_paused = False

    def get_server_address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)

    def body_of(self, prompt_ids: list[int], sampling_params: dict) -> tuple[dict, bool]:
        """verl's sampling params as grctl's: logprobs -> return_logprob, max_tokens (vLLM's) ->
        max_new_tokens, by default the rest of the response budget (SGLang's actor's rule)."""
        sp = {**self.defaults, **sampling_params}
        sp.pop("stage1_sample_idx", None)  # verl-GR's agent loop's bookkeeping, not a param
        return_logprob = bool(sp.pop("logprobs", False))
        if sp.pop("prompt_logprobs", None) is not None:
            raise ValueError("rollout.name=grctl does not return prompt logprobs to verl")
        limit, vllm_limit = sp.pop("max_new_tokens", None), sp.pop("max_tokens", None)
        limit = vllm_limit if limit is None else limit
        if limit is None:
            cfg = self.config
            budget = cfg.prompt_length + cfg.response_length - len(prompt_ids)
            limit = min(cfg.response_length, budget)
        sp["max_new_tokens"] = max(0, int(limit))
        return sp, return_logprob

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data"):
            raise ValueError("rollout.name=grctl serves token ids: no image, video or audio")
        sp, return_logprob = self.body_of(list(prompt_ids), sampling_params)
        while True:
            try:
                reply = await self.client.generate(
                    list(prompt_ids), sp, rid=request_id, return_logprob=return_logprob
                )
                break
            except GrctlError as exc:
                if exc.code != "paused" or self.reject_while_paused:
                    raise
            await asyncio.sleep(PAUSED_POLL_S)
        meta = reply.meta_info
        version = meta.weight_version
        extra: dict[str, Any] = {
            "global_steps": int(version) if version.isdigit() else self.global_steps,
            "weight_version": version,
            "num_cached_tokens": meta.cached_tokens,
        }
        if meta.item_results:
            extra["item_id"] = meta.item_results[0].item_id
        if meta.stage_groups:  # a multi-stage reply: what verl-GR's rollout server returns
            spans = meta.beam_results[0].meta_info.stage_spans or ()
            extra["generated_items"] = [  # the item stage's tokens (catalog or free beams)
                t
                for sp_ in spans
                if sp_.kind == "searched"
                for t in reply.output_ids[sp_.start : sp_.end]
            ]
            if meta.beam_group_id is not None:
                extra["_beam_group_id"] = meta.beam_group_id
                extra["_beam_index"] = meta.beam_index
        logprobs = None
        if return_logprob:  # forced prefix tokens (null: not drawn) as verl-GR counts them, 0.0
            logprobs = [
                0.0 if e[0] is None else float(e[0]) for e in meta.output_token_logprobs or ()
            ]
        return TokenOutput(
            token_ids=list(reply.output_ids),
            log_probs=logprobs,
            stop_reason=meta.finish_reason.type,
            extra_fields=extra,
        )

    async def wake_up(self) -> None:
        if self.rollout_mode == RolloutMode.HYBRID:
            raise ValueError("a hybrid rollout wakes in update_weights (the trainer's adapter)")
        colocated = self.rollout_mode == RolloutMode.COLOCATED
        await self.client.resume_memory_occupation(
            ["kv_cache", "weights"] if colocated else ["kv_cache"]
        )
        await self.client.flush_cache_until_ok()

    async def sleep(self) -> None:
        if not self.config.free_cache_engine:
            return
        standalone = self.rollout_mode == RolloutMode.STANDALONE
        await self.client.release_memory_occupation(
            ["kv_cache"] if standalone else ["kv_cache", "weights"]
        )

    async def clear_kv_cache(self) -> None:
        await self.client.flush_cache_until_ok()

    async def release_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await self.client.release_memory_occupation(["kv_cache"])

    async def resume_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await self.client.resume_memory_occupation(["kv_cache"])
            await self.client.flush_cache_until_ok()

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Requests in flight end as "abort" (verl resumes them); later ones wait for
        resume_generation, or fail at once with reject_request."""
        self.reject_while_paused = reject_request
        await self.client.pause_generation("abort")

    async def resume_generation(self) -> None:
        self.reject_while_paused = False
        await self.client.continue_generation()

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def start_profile(self, **kwargs: Any) -> None:
        log.warning("rollout.name=grctl: profile the server with grctl's /start_profile")

    async def stop_profile(self) -> None:
        pass


class GrctlReplica(RolloutReplica):
    """One replica: no server launched, one actor that talks to the configured grctl server."""

    async def launch_servers(self) -> None:
        url = server_url(self.config, self.replica_rank)
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        server = (
            ray.remote(GrctlServer)
            .options(
                name=f"grctl_server_{role}{self.replica_rank}{self.name_suffix}",
                max_concurrency=self.max_concurrency,
                num_cpus=0,
            )
            .remote(url, self.config, self.replica_rank, self.rollout_mode)
        )
        host, port = await server.get_server_address.remote()
        self.servers, self._server_handle = [server], server
        self._server_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
