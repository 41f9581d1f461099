"""Weight-sync control routes (docs/http-api.md "Weight sync"), off unless --allow-weight-update:
pause and continue, the version label, SGLang's update session, reading the weights back.

Handlers stay thin: parse a Struct, call the engine or the WeightUpdater (app.state.updater) in a
worker thread, return a Struct. The routes sit on one Router that carries the
--allow-weight-update guard; the session and /weights_checker sit on a nested Router with opt
sglang_errors=True, so their errors also hold top-level `success: false` and `message`, which
SGLang-style clients read. The routes that write weights are in routes/updates.py.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated

import msgspec
from litestar import Request, Router, get, post, route
from litestar.datastructures import State
from litestar.params import Body

from grctl.errors import ValidationError
from grctl.protocol.weights import (
    BeginWeightUpdateBody,
    ContinueResponse,
    GetWeightsBody,
    GetWeightsResponse,
    ParallelismRole,
    PauseBody,
    PauseResponse,
    RankChecksums,
    StrictWeightsCheckerResponse,
    SuccessResponse,
    TensorChecksum,
    UpdateWeightVersionBody,
    UpdateWeightVersionResponse,
    WeightsCheckerBody,
    WeightsCheckerResponse,
    WeightVersionResponse,
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
from grctl.server.params import merged_params
from grctl.weights import checker
from grctl.weights.views import read_rows


@post("/pause_generation", status_code=200, summary="Pause: abort | retract | in_place")
async def pause_generation(
    state: State, data: Annotated[PauseBody | None, Body()] = None
) -> PauseResponse:
    mode = (data or PauseBody()).mode
    num = await offload(state, state.engine.pause, mode)
    if mode == "abort":  # the groups it cut short, and every kept one (verl-GR's reset)
        await offload(state, state.beam_groups.clear)
    logs.event("pause", mode=mode, aborted=num)
    return PauseResponse(paused=True, mode=mode, num_aborted_requests=num)


@post(
    "/continue_generation",
    status_code=200,
    summary="Resume generation after a pause (409 while the weights are mixed or torn)",
)
async def continue_generation(state: State) -> ContinueResponse:
    state.engine.resume()
    logs.event("continue")
    return ContinueResponse(paused=False)


@get(
    "/get_weight_version",
    summary="The served weight version, step, update count, labels and torn tensors",
)
async def get_weight_version(state: State) -> WeightVersionResponse:
    info = state.updater.versions.as_dict()
    return WeightVersionResponse(
        weight_version=info["weight_version"],
        token_step=info["token_step"],
        weight_update_count=info["weight_update_count"],
        weights_mixed=info["weights_mixed"],
        label_counts=info["label_counts"],
        weights_torn=info["weights_torn"],
        torn_tensors=info["torn_tensors"],
        discarded_tensors=info["discarded_tensors"],
    )


@post(
    "/begin_weight_update",
    status_code=200,
    summary="Open SGLang's weight-update session (updates work without one too)",
)
async def begin_weight_update(
    state: State, data: Annotated[BeginWeightUpdateBody | None, Body()] = None
) -> SuccessResponse:
    body = data or BeginWeightUpdateBody()
    check_selector(body.selector)
    catalog_path = checked_catalog_path(state, body.catalog_path)
    await offload(state, state.updater.begin_session, catalog_path)
    message = "weight update session opened"
    if catalog_path is not None:
        message += f"; catalog {catalog_path!r} built, installed at /end_weight_update"
    return SuccessResponse(success=True, message=message)


@post(
    "/end_weight_update",
    status_code=200,
    summary="Close the session: the label counts; 409 weights_mixed if it leaves them mixed",
)
async def end_weight_update(state: State) -> SuccessResponse:
    message = await offload(state, state.updater.end_session)
    return SuccessResponse(success=True, message=message)


@post("/update_weight_version", status_code=200, summary="Relabel the live weights")
async def update_weight_version(
    state: State, data: Annotated[UpdateWeightVersionBody | None, Body()] = None
) -> UpdateWeightVersionResponse:
    body = data or UpdateWeightVersionBody()
    new_version = version_str(body.new_version)
    if new_version is None:
        raise ValidationError("new_version is required")
    await offload(state, state.updater.set_version, new_version, body.abort_all_requests)
    logs.event("weight_version", version=new_version)
    return UpdateWeightVersionResponse(
        success=True, new_version=new_version, message=f"Weight version updated to {new_version}"
    )


@route(
    "/get_weights_by_name",
    http_method=["GET", "POST"],
    status_code=200,
    summary="Read a parameter back",
)
async def get_weights_by_name(state: State, request: Request) -> GetWeightsResponse:
    try:
        body = msgspec.convert(await merged_params(request), GetWeightsBody, strict=False)
    except msgspec.ValidationError as exc:
        raise ValidationError(f"bad get_weights_by_name body: {exc}") from exc
    if not body.name:
        raise ValidationError("name is required")
    require_weights(state)
    # In a worker thread and between updates: a read never sees a half-written model.
    read = partial(read_rows, state.engine.model, body.name, body.truncate_size)
    return GetWeightsResponse(parameter=await offload(state, state.updater.read, read))


@route(
    "/weights_checker",
    http_method=["GET", "POST"],
    status_code=200,
    summary="checksum (the default) | snapshot | reset_tensors | compare",
)
async def weights_checker(state: State, request: Request) -> WeightsCheckerResponse:
    try:  # a JSON body, or the query of a GET
        body = msgspec.convert(await merged_params(request), WeightsCheckerBody, strict=False)
    except msgspec.ValidationError as exc:
        raise ValidationError(f"bad weights_checker body: {exc}") from exc
    action, skip = body.action, body.skip_tensor_list
    check_selector(body.selector)
    require_weights(state)
    model, wc, read = state.engine.model, state.weights_checker, state.updater.read
    # Each read runs between updates (the updater's lock), in a worker thread.
    if action == "checksum":
        sums = await offload(state, read, checker.checksums, model, skip)
        return checksum_response(state, sums)
    if action == "snapshot":
        n = await offload(state, read, wc.snapshot, model)
        return StrictWeightsCheckerResponse(success=True, message=f"snapshot of {n} parameters")
    if action == "reset_tensors":
        n = await offload(state, state.updater.reset_tensors, skip)
        return StrictWeightsCheckerResponse(success=True, message=f"reset {n} tensors")
    if action == "compare":
        bad = await offload(state, read, wc.compare, model, skip)
        if bad:
            raise ValidationError(
                f"{len(bad)} parameter(s) differ from the snapshot: " + ", ".join(bad[:16])
            )
        return StrictWeightsCheckerResponse(
            success=True, message="all parameters equal the snapshot"
        )
    raise ValidationError(
        f"unknown action {action!r}; use checksum, snapshot, reset_tensors or compare"
    )


def checksum_response(state: State, sums: dict[str, dict]) -> StrictWeightsCheckerResponse:
    """grctl's `tensors` (sha256, dtype, shape by HF name) and SGLang 0.5.23's `ranks`: one
    rank here, whose checksums are the same sha256 digests."""
    digests = {name: t["sha256"] for name, t in sums.items()}
    rank = RankChecksums(
        checksums=digests,
        per_gpu_checksum=checker.digest_of(digests),
        parallelism_info=[ParallelismRole()],
    )
    return StrictWeightsCheckerResponse(
        success=True,
        message="Success.",
        weight_version=state.engine.gate.label,
        algorithm=checker.ALGORITHM,
        tensors={k: TensorChecksum(**v) for k, v in sums.items()},
        ranks=[rank],
        per_engine_checksum=checker.digest_of_ranks([rank.per_gpu_checksum]),
    )


# Every route here needs --allow-weight-update; the update session and /weights_checker (a failed
# compare, as SGLang's) also answer errors with SGLang's top-level success/message.
weight_router = Router(
    path="/",
    guards=[weight_update_guard],
    route_handlers=[
        pause_generation,
        continue_generation,
        get_weight_version,
        update_weight_version,
        get_weights_by_name,
        Router(
            path="/",
            opt=SGLANG_ERRORS,
            route_handlers=[
                begin_weight_update,
                end_weight_update,
                weights_checker,
            ],
        ),
    ],
)
