"""Weight broadcast routes (docs/http-api.md "Weight sync"): a trainer's process group, its updates.

Each blocking call (the group join waits for the trainer; an update waits for its broadcast) runs
in a worker thread, so the event loop keeps serving while a trainer is slow or gone. The groups
live in a GroupRegistry on app.state, made on first use.
"""

from __future__ import annotations

from litestar import Router, post
from litestar.datastructures import State

from grctl.protocol.weights import (
    DestroyGroupBody,
    InitGroupBody,
    SuccessResponse,
    UpdateFromDistributedBody,
)
from grctl.server.exceptions import SGLANG_ERRORS
from grctl.server.guards import require_weights, weight_update_guard
from grctl.server.offload import offload
from grctl.server.routes.weights import log_update, update_options
from grctl.weights import distributed
from grctl.weights.process_group import GroupRegistry, check_init_args


def groups(state: State) -> GroupRegistry:
    if "weight_groups" not in state:
        state.weight_groups = GroupRegistry()
    return state.weight_groups


@post(
    "/init_weights_update_group",
    status_code=200,
    summary="Join the trainer's process group (blocks until the trainer joins as rank 0)",
)
async def init_weights_update_group(
    state: State, data: InitGroupBody | None = None
) -> SuccessResponse:
    body = data or InitGroupBody()
    backend = check_init_args(
        state.engine.model,
        body.master_address,
        body.master_port,
        body.rank_offset,
        body.world_size,
        body.backend,
    )
    # grctl serves on one rank, so this server's rank is rank_offset itself.
    rank = body.rank_offset
    args = (body.group_name, backend, body.master_address, body.master_port, rank, body.world_size)
    await offload(state, groups(state).init, *args)
    return SuccessResponse(
        success=True,
        message=f"Succeeded to join group {body.group_name!r} as rank {rank} of "
        f"{body.world_size} ({backend}).",
    )


@post(
    "/update_weights_from_distributed",
    status_code=200,
    summary="Receive a broadcast from rank 0 of a group and load it in place",
)
async def update_weights_from_distributed(
    state: State, data: UpdateFromDistributedBody | None = None
) -> SuccessResponse:
    body = data or UpdateFromDistributedBody()
    require_weights(state)
    specs = distributed.parse_specs(body.names, body.dtypes, body.shapes)
    outcome = await offload(
        state,
        distributed.update_from_distributed,
        state.updater,
        groups(state),
        body.group_name,
        specs,
        load_format=body.load_format,
        **update_options(body),
    )
    log_update(state, "distributed", outcome)
    return SuccessResponse(
        success=True,
        message=f"Succeeded to update {outcome.tensors_loaded} tensors from group "
        f"{body.group_name!r} in {outcome.elapsed_ms:.0f} ms.",
    )


@post(
    "/destroy_weights_update_group",
    status_code=200,
    summary="Leave and destroy a weight update group",
)
async def destroy_weights_update_group(
    state: State, data: DestroyGroupBody | None = None
) -> SuccessResponse:
    body = data or DestroyGroupBody()
    await offload(state, groups(state).destroy, body.group_name)
    return SuccessResponse(success=True, message=f"Destroyed group {body.group_name!r}.")


distributed_router = Router(
    path="/",
    guards=[weight_update_guard],
    opt=SGLANG_ERRORS,
    route_handlers=[
        init_weights_update_group,
        update_weights_from_distributed,
        destroy_weights_update_group,
    ],
)
