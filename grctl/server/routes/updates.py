"""The routes that write weights (docs/http-api.md "Weight sync"), by transport: a checkpoint on
disk, a pushed tensor chunk, a broadcast in a trainer's process group (and that group's join
and leave). Off unless --allow-weight-update; their errors also hold SGLang's top-level
`success: false` and `message`.

Every update may carry `catalog_path`, the catalog of its weights: built and checked before the
weights are touched, installed with them (WeightUpdater.run). Each blocking call (a load; the
group join waits for the trainer; an update waits for its broadcast; a catalog build) runs in a
worker thread, so the event loop keeps serving while a trainer is slow or
gone. Each update ends in the WeightUpdater (app.state.updater). The groups live in a
GroupRegistry on app.state, made on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from litestar import Router, post
from litestar.datastructures import State
from litestar.params import Body

from grctl.errors import Forbidden, GrctlError, ValidationError
from grctl.protocol.weights import (
    DestroyGroupBody,
    InitGroupBody,
    SuccessResponse,
    UpdateFromDiskBody,
    UpdateFromDistributedBody,
    UpdateFromTensorBody,
    UpdateWeightsResponse,
    version_str,
)
from grctl.server import logs
from grctl.server.exceptions import SGLANG_ERRORS
from grctl.server.guards import (
    check_selector,
    checked_catalog_path,
    require_weights,
    weight_update_guard,
)
from grctl.server.offload import offload
from grctl.weights import disk, distributed, tensor
from grctl.weights.process_group import GroupRegistry, check_init_args


def checked_model_path(state: State, body: UpdateFromDiskBody) -> str:
    path = body.model_path or body.model_dir
    if not path:
        raise ValidationError("model_path is required (alias model_dir)")
    if "\x00" in path:
        raise ValidationError("model_path contains a NUL byte")
    root = state.config.weights_root
    if root is not None:
        resolved, allowed = Path(path).resolve(), Path(root).resolve()
        if resolved != allowed and allowed not in resolved.parents:
            raise Forbidden(
                f"model_path {path!r} resolves outside the weights root",
                hint=f"updates from disk may only read under {str(allowed)!r} (--weights-root)",
            )
    return path


@post(
    "/update_weights_from_disk",
    status_code=200,
    summary="Load an HF checkpoint from disk into the live model, in place",
)
async def update_weights_from_disk(
    state: State, data: Annotated[UpdateFromDiskBody | None, Body()] = None
) -> UpdateWeightsResponse:
    body = data or UpdateFromDiskBody()
    require_weights(state)
    path = checked_model_path(state, body)
    if body.load_format not in (None, "auto", "safetensors", "pt"):
        raise ValidationError(
            f"load_format {body.load_format!r} is not supported from disk; omit it or use auto"
        )
    outcome = await offload(
        state,
        disk.update_from_disk,
        state.updater,
        path,
        root=state.config.weights_root,  # checked again on each file opened (confined.py)
        **update_options(state, body),
    )
    state.model_path = path
    return update_response(
        state, outcome, "Succeeded to update model weights from disk.", path, transport="disk"
    )


@post(
    "/update_weights_from_tensor",
    status_code=200,
    summary="Apply one pushed chunk (SGLang wire format: CUDA IPC or shared memory)",
)
async def update_weights_from_tensor(
    state: State, data: Annotated[UpdateFromTensorBody | None, Body()] = None
) -> UpdateWeightsResponse:
    body = data or UpdateFromTensorBody()
    if body.serialized_named_tensors is None:
        raise ValidationError("serialized_named_tensors is required")
    check_selector(body.selector)
    refuse_custom_loader(body.load_format)
    require_weights(state)
    outcome = await offload(
        state,
        tensor.update_from_tensor,
        state.updater,
        body.serialized_named_tensors,
        body.load_format,
        **update_options(state, body),
    )
    return update_response(
        state, outcome, "Succeeded to update model weights from tensor.", transport="tensor"
    )


def refuse_custom_loader(load_format: str | None) -> None:
    """SGLang runs a load_format that is an import path as a weight loader; grctl runs no code
    named by a request. verl's delta sync sends one (sparse positions and values)."""
    if load_format is not None and "." in load_format:
        raise ValidationError(
            f"load_format {load_format!r} names a custom weight loader (verl's delta sync sends "
            "one); grctl does not run loaders named in a request",
            hint="send full tensors with load_format null, 'direct' or 'flattened_bucket'; "
            "in verl, turn delta weight sync off",
        )


def update_options(state: State, body) -> dict:
    """The options every update route shares, as WeightUpdater.run takes them."""
    return {
        "weight_version": version_str(body.weight_version),
        "token_step": body.token_step,
        "flush_cache": body.flush_cache,
        "abort_all_requests": body.abort_all_requests,
        "catalog_path": checked_catalog_path(state, body.catalog_path),
    }


def update_response(
    state: State, outcome, message: str, model_dir: str | None = None, *, transport: str
):
    log_update(state, transport, outcome)
    return UpdateWeightsResponse(
        success=True,
        message=message,
        model_dir=model_dir,
        tensors_loaded=outcome.tensors_loaded,
        flushed_cache=outcome.flushed_cache,
        num_aborted_requests=outcome.num_aborted_requests,
        weight_version=outcome.weight_version,
        token_step=outcome.token_step,
        elapsed_ms=outcome.elapsed_ms,
        catalog_version=outcome.catalog_version,
    )


def log_update(state: State, transport: str, outcome) -> None:
    logs.event(
        "weight_update",
        transport=transport,
        tensors=outcome.tensors_loaded,
        bytes=outcome.num_bytes,
        ms=outcome.elapsed_ms,
        version=outcome.weight_version,
        aborted=outcome.num_aborted_requests,
        flushed_cache=outcome.flushed_cache,
        catalog=outcome.catalog_version,
    )


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
    state: State, data: Annotated[InitGroupBody | None, Body()] = None
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
    state: State, data: Annotated[UpdateFromDistributedBody | None, Body()] = None
) -> SuccessResponse:
    body = data or UpdateFromDistributedBody()
    # No require_weights here: released weights are refused after the broadcast is received.
    specs = distributed.parse_specs(body.names, body.dtypes, body.shapes)
    try:  # refused by its options (a catalog_path, a selector): the broadcast is still taken
        check_selector(body.selector)
        options, refusal = update_options(state, body), None
    except GrctlError as exc:
        options, refusal = {}, exc
    if refusal is not None and not groups(state).has(body.group_name):
        raise refusal  # no such group: no broadcast to drain, the options' refusal says why
    outcome = await offload(
        state,
        distributed.update_from_distributed,
        state.updater,
        groups(state),
        body.group_name,
        specs,
        load_format=body.load_format,
        refusal=refusal,
        **options,
    )
    log_update(state, "distributed", outcome)
    catalog = "" if outcome.catalog_version is None else f"; catalog {outcome.catalog_version}"
    return SuccessResponse(
        success=True,
        message=f"Succeeded to update {outcome.tensors_loaded} tensors from group "
        f"{body.group_name!r} in {outcome.elapsed_ms:.0f} ms{catalog}.",
    )


@post(
    "/destroy_weights_update_group",
    status_code=200,
    summary="Leave and destroy a weight update group",
)
async def destroy_weights_update_group(
    state: State, data: Annotated[DestroyGroupBody | None, Body()] = None
) -> SuccessResponse:
    body = data or DestroyGroupBody()
    await offload(state, groups(state).destroy, body.group_name)
    return SuccessResponse(success=True, message=f"Destroyed group {body.group_name!r}.")


update_router = Router(
    path="/",
    guards=[weight_update_guard],
    opt=SGLANG_ERRORS,
    route_handlers=[
        update_weights_from_disk,
        update_weights_from_tensor,
        init_weights_update_group,
        update_weights_from_distributed,
        destroy_weights_update_group,
    ],
)
