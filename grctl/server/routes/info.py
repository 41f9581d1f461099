"""Health, readiness, status, metrics, discovery and /flush_cache (always on)."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.enums import MediaType
from litestar.params import Body, Parameter

import grctl
from grctl.engine.request import GenerateRequest, SamplingParams, new_request_id
from grctl.errors import CacheBusy, GrctlError, NotReady, ValidationError
from grctl.model.device import gpu_uuid
from grctl.model.dtypes import name_of
from grctl.protocol.info import (
    FlushCacheBody,
    FlushCacheResponse,
    HealthResponse,
    ModelInfo,
    ParallelismConfig,
    ReadyResponse,
    ServerInfo,
    StrictFlushCacheResponse,
)
from grctl.server.offload import offload
from grctl.server.params import seconds

EXEMPT = {"auth_exempt": True}
HEALTH_GENERATE_TIMEOUT_S = 30.0


def served_model_name(state: State) -> str:
    return state.config.served_model_name or state.model_path


@get("/health", opt=EXEMPT, summary="Liveness: the HTTP server answers")
async def health() -> HealthResponse:
    return HealthResponse(ok=True)


@get("/ready", opt=EXEMPT, summary="Readiness: 200 when the engine takes requests, else 503")
async def ready(state: State) -> Response[ReadyResponse]:
    engine = state.engine
    reasons = engine.ready_reasons()
    body = ReadyResponse(
        ready=not reasons,
        reasons=reasons,
        paused=engine.gate.is_paused,
        weight_version=engine.gate.label,
        num_in_flight=engine.num_in_flight(),
    )
    return Response(body, status_code=503 if reasons else 200)


@get("/status", summary="Scheduler, prefill cache, engine, weights and catalog state")
async def status(state: State) -> dict[str, Any]:
    engine = state.engine
    return {
        **engine.status(),
        "weights": state.updater.versions.as_dict(),
        "catalog": engine.catalogs.status(),
    }


@get(
    "/metrics",
    media_type=MediaType.TEXT,
    opt={"metrics": True},  # open unless --metrics-auth (auth.py)
    summary="Prometheus text format",
)
async def metrics(state: State) -> str:
    # the engine's families are read under its lock at scrape time: off the loop
    return await offload(state, state.metrics.render)


WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def served_host(state: State, request: Request) -> str:
    """The host the server is bound to; bound to every interface, the address this request
    reached (what a client that dialled an address will compare with, as miles does)."""
    host = state.config.host
    local = request.scope.get("server")
    if host in WILDCARD_HOSTS and local:
        return str(local[0])
    return host


@get(
    ["/server_info", "/get_server_info"],
    summary="Server arguments slime and miles read at start",
)
async def server_info(state: State, request: Request) -> ServerInfo:
    cfg, model = state.config.engine, state.engine.model
    param = next(model.parameters())
    return ServerInfo(
        model_path=state.model_path,
        weight_version=state.engine.gate.label,
        host=served_host(state, request),
        port=state.config.port,
        base_gpu_id=param.device.index or 0,
        device=str(param.device),
        gpu_uuid=gpu_uuid(param.device),
        dtype=name_of(param.dtype),
        served_model_name=served_model_name(state),
        enable_memory_saver=state.config.enable_memory_saver,
        context_length=state.engine.max_context_len,
        max_running_requests=cfg.max_running_requests,
        max_waiting_requests=cfg.max_waiting_requests,
        max_beam_width=cfg.max_beam_width,
        max_new_tokens=cfg.max_new_tokens,
        enable_prefill_cache=cfg.enable_prefill_cache,
        allow_weight_update=state.config.allow_weight_update,
        version=grctl.__version__,
    )


@get("/parallelism_config", summary="This server's place in SGLang's parallelism (one rank)")
async def parallelism_config(rank: int = Parameter(default=0)) -> ParallelismConfig:
    if rank != 0:
        raise ValidationError(
            f"rank {rank} does not exist: grctl serves on one rank (tp=dp=pp=ep=1)",
            hint="ask for rank=0",
        )
    return ParallelismConfig()


@get(["/model_info", "/get_model_info"], summary="The served model and its weight version")
async def model_info(state: State) -> ModelInfo:
    return ModelInfo(
        model_path=state.model_path,
        served_model_name=served_model_name(state),
        weight_version=state.engine.gate.label,
        tokenizer_path=state.model_path if state.tokenizer is not None else None,
        vocab_size=state.engine.model.config.vocab_size,
        model_config=state.engine.model.config.to_hf(),
    )


@get("/health_generate", summary="Runs a one-token generate: 200, or 503 when it cannot")
async def health_generate(state: State) -> HealthResponse:
    req = GenerateRequest(
        input_ids=(0,),
        sampling=SamplingParams(max_new_tokens=1, ignore_eos=True),
        request_id=f"health_generate-{new_request_id()}",
    )
    try:
        await offload(
            state,
            state.engine.generate,
            req,
            timeout=HEALTH_GENERATE_TIMEOUT_S,
            on_cancel=lambda: state.engine.discard([req.request_id]),
        )
    except GrctlError as exc:
        raise NotReady(f"health generate failed: {exc}") from exc
    return HealthResponse(ok=True)


def flush_hint(pause_mode: str | None) -> str:
    """What would let the flush through, given how the server is (or is not) paused."""
    if pause_mode == "in_place":
        return (
            "the server is paused in_place, which keeps the requests' KV: resume it, or pause "
            "with mode abort or retract, then flush"
        )
    if pause_mode is not None:  # abort/retract: only the step in flight holds KV, briefly
        return "the step in flight ends shortly: retry"
    return "pause generation first (POST /pause_generation), then retry"


async def flush(state: State, timeout: float | None) -> Response[FlushCacheResponse]:
    """Answers at once: `timeout` is checked (SGLang sends one) and never waited on, as the
    guide says, so no flush parks a thread that every blocking route needs."""
    seconds(timeout, limit=0.0, default=0.0)
    ok, cleared = state.engine.flush_cache()
    if ok:
        body = StrictFlushCacheResponse(success=True, entries_cleared=cleared)
        return Response(body, status_code=200)
    busy = CacheBusy(
        "cannot flush the cache while requests hold KV or are being computed",
        hint=flush_hint(state.engine.gate.pause_mode),
    )
    body = StrictFlushCacheResponse(success=False, message=str(busy), error=busy.to_dict())
    return Response(body, status_code=400)


TimeoutQuery = Parameter(default=None, description="accepted (SGLang's) and never waited on")


@get("/flush_cache", summary="Clear the prefill cache at once (SGLang-style 400 while busy)")
async def flush_cache_get(
    state: State, timeout: float | None = TimeoutQuery
) -> Response[FlushCacheResponse]:
    return await flush(state, timeout)


@post(
    "/flush_cache",
    status_code=200,
    summary="Clear the prefill cache; `timeout` from the query or the body",
)
async def flush_cache_post(
    state: State,
    data: Annotated[FlushCacheBody | None, Body()] = None,
    timeout: float | None = TimeoutQuery,
) -> Response[FlushCacheResponse]:
    body_timeout = data.timeout if data else None
    return await flush(state, timeout if timeout is not None else body_timeout)


info_routes = [
    health,
    ready,
    status,
    metrics,
    server_info,
    parallelism_config,
    model_info,
    health_generate,
    flush_cache_get,
    flush_cache_post,
]
