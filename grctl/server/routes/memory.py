"""/release_memory_occupation and /resume_memory_occupation: verl's colocated rollout.

verl (free_cache_engine=True) frees the rollout's GPU memory before training and brings it back
before the next rollout: release {"tags": ["kv_cache", "weights"]}, later resume {"tags":
["weights"]}, a weight push, resume {"tags": ["kv_cache"]}. Tags are SGLang's (`kv_cache`,
`weights`, `cuda_graph`; null or [] = all); grctl/engine/memory.py says what each frees. While
anything is released, /generate is a retryable 503 `memory_released`. Served, as in SGLang,
whether or not the memory saver is reported on (`--enable-memory-saver` only sets what
/server_info says, which slime compares with its own --offload-rollout); like every route that
touches the weights, they need --allow-weight-update.
"""

from __future__ import annotations

import msgspec
from litestar import Request, Router, route
from litestar.datastructures import State

from grctl.errors import ValidationError
from grctl.protocol.weights import MemoryBody, MemoryResponse
from grctl.server.guards import weight_update_guard
from grctl.server.offload import offload
from grctl.server.openapi import error_responses
from grctl.server.params import merged_params


async def tags_of(request: Request) -> list[str] | None:
    """SGLang takes GET and POST alike, the tags in a JSON body (or the query)."""
    try:
        body = msgspec.convert(await merged_params(request), MemoryBody, strict=False)
    except msgspec.ValidationError as exc:
        raise ValidationError(f"bad tags: {exc}", hint='send {"tags": ["kv_cache"]}') from exc
    return body.tags


@route(
    "/release_memory_occupation",
    http_method=["GET", "POST"],
    status_code=200,
    summary="Free device memory by tag (kv_cache, weights, cuda_graph; none: all)",
    responses=error_responses(400, 409),
)
async def release_memory_occupation(state: State, request: Request) -> MemoryResponse:
    tags = await tags_of(request)
    released = await offload(state, state.engine.release_memory, tags)
    return MemoryResponse(
        success=True, message=f"Released {', '.join(released)}.", released=released
    )


@route(
    "/resume_memory_occupation",
    http_method=["GET", "POST"],
    status_code=200,
    summary="Bring released memory back by tag (none: all); generation resumes when all are",
    responses=error_responses(400),
)
async def resume_memory_occupation(state: State, request: Request) -> MemoryResponse:
    tags = await tags_of(request)
    released = await offload(state, state.engine.resume_memory, tags)
    left = f" Still released: {', '.join(released)}." if released else ""
    return MemoryResponse(success=True, message=f"Resumed.{left}", released=released)


memory_router = Router(
    path="/",
    guards=[weight_update_guard],
    route_handlers=[release_memory_occupation, resume_memory_occupation],
)
