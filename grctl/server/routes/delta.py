"""/pull_weights: a delta sync (miles' disk-delta name), applied onto the served weights.

The body names a source directory and a version; the server reads `weight_v{version:06d}` there
(grctl/weights/delta.py: the layout, the encodings, the base and checksum checks) and applies it
in place through the WeightUpdater, as any update. Off unless --allow-weight-update; the source
must lie under --weights-root when one is set. miles' `local_checkpoint_dir` is refused: grctl
keeps no host-local checkpoint to patch, so a reload of one after the pull would serve stale
weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from litestar import Router, post
from litestar.datastructures import State
from litestar.params import Body

from grctl.errors import Forbidden, ValidationError
from grctl.protocol.weights import PullWeightsBody, UpdateWeightsResponse, version_str
from grctl.server.exceptions import SGLANG_ERRORS
from grctl.server.guards import checked_catalog_path, require_weights, weight_update_guard
from grctl.server.offload import offload
from grctl.server.routes.updates import update_response
from grctl.weights import delta


def checked_source(state: State, body: PullWeightsBody) -> Path:
    if body.local_checkpoint_dir is not None:
        raise ValidationError(
            "local_checkpoint_dir: grctl applies the delta into the served weights and keeps "
            "no local checkpoint",
            hint="omit local_checkpoint_dir and skip the update_weights_from_disk reload that "
            "follows a pull in miles",
        )
    if not body.source_dir or body.target_version is None:
        raise ValidationError("source_dir and target_version are required")
    if "\x00" in body.source_dir:
        raise ValidationError("source_dir contains a NUL byte")
    vdir = delta.version_dir(body.source_dir, body.target_version)
    root = state.config.weights_root
    if root is not None:
        resolved, allowed = vdir.resolve(), Path(root).resolve()
        if allowed not in resolved.parents:
            raise Forbidden(
                f"source_dir {body.source_dir!r} resolves outside the weights root",
                hint=f"deltas may only be read under {str(allowed)!r} (--weights-root)",
            )
    return vdir


@post(
    "/pull_weights",
    status_code=200,
    summary="Apply a delta version (changed bytes of a step) onto the served weights, in place",
)
async def pull_weights(
    state: State, data: Annotated[PullWeightsBody | None, Body()] = None
) -> UpdateWeightsResponse:
    body = data or PullWeightsBody()
    vdir = checked_source(state, body)
    require_weights(state)
    label = version_str(body.weight_version)
    outcome = await offload(
        state,
        delta.update_from_delta,
        state.updater,
        vdir,
        weight_version=str(body.target_version) if label is None else label,
        token_step=body.token_step,
        flush_cache=body.flush_cache,
        abort_all_requests=body.abort_all_requests,
        catalog_path=checked_catalog_path(state, body.catalog_path),
    )
    return update_response(
        state, outcome, "Succeeded to apply the weight delta.", str(vdir), transport="delta"
    )


delta_router = Router(
    path="/", guards=[weight_update_guard], opt=SGLANG_ERRORS, route_handlers=[pull_weights]
)
