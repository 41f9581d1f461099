"""/pull_weights: a delta sync (miles' disk-delta name).

The body names a source directory and a version; the server reads `weight_v{version:06d}` there
(grctl/weights/delta.py: the layout, the encodings, the base and checksum checks) and applies it
in place through the WeightUpdater, as any update. With `local_checkpoint_dir` (miles' form) it
writes no served weight: version 0 copies the served base checkpoint there, a later version is
applied onto that directory's files (grctl/weights/local_checkpoint.py), and the caller reloads
it with /update_weights_from_disk. Off unless --allow-weight-update; every path must lie under
--weights-root when one is set.
"""

from __future__ import annotations

import time
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
from grctl.weights import delta, local_checkpoint


def confined(state: State, field: str, value: str, path: Path) -> Path:
    if "\x00" in value:
        raise ValidationError(f"{field} contains a NUL byte")
    root = state.config.weights_root
    if root is not None:
        resolved, allowed = path.resolve(), Path(root).resolve()
        if allowed not in resolved.parents:
            raise Forbidden(
                f"{field} {value!r} resolves outside the weights root",
                hint=f"deltas may only be read and written under {str(allowed)!r} (--weights-root)",
            )
    return path


def weights_root(state: State) -> Path | None:
    """--weights-root, which every file a pull opens is checked against again, through its
    descriptor (grctl/confined.py): the route's check above is on the path, before the open."""
    root = state.config.weights_root
    return None if root is None else Path(root)


def checked_source(state: State, body: PullWeightsBody) -> Path:
    if not body.source_dir or body.target_version is None:
        raise ValidationError("source_dir and target_version are required")
    vdir = delta.version_dir(body.source_dir, body.target_version)
    return confined(state, "source_dir", body.source_dir, vdir)


def checked_local(state: State, body: PullWeightsBody) -> Path:
    if not body.local_checkpoint_dir:
        raise ValidationError("local_checkpoint_dir must be a non-empty path")
    for name in ("weight_version", "catalog_path", "token_step"):
        if getattr(body, name) is not None:
            raise ValidationError(
                f"{name} with local_checkpoint_dir: the pull writes no served weight",
                hint=f"send {name} with the /update_weights_from_disk that loads the directory",
            )
    local = Path(body.local_checkpoint_dir)
    return confined(state, "local_checkpoint_dir", body.local_checkpoint_dir, local)


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
    if body.local_checkpoint_dir is not None:
        return await pull_into_local(state, body, checked_local(state, body), vdir)
    require_weights(state)
    label = version_str(body.weight_version)
    outcome = await offload(
        state,
        delta.update_from_delta,
        state.updater,
        vdir,
        weight_version=str(body.target_version) if label is None else label,
        root=weights_root(state),
        token_step=body.token_step,
        flush_cache=body.flush_cache,
        abort_all_requests=body.abort_all_requests,
        catalog_path=checked_catalog_path(state, body.catalog_path),
    )
    return update_response(
        state, outcome, "Succeeded to apply the weight delta.", str(vdir), transport="delta"
    )


async def pull_into_local(
    state: State, body: PullWeightsBody, local: Path, vdir: Path
) -> UpdateWeightsResponse:
    base = state.config.engine.model_path
    if not base:
        raise ValidationError(
            "local_checkpoint_dir needs a served checkpoint directory to seed from",
            hint="start the server with --model-path DIR",
        )
    t0 = time.perf_counter()
    versions, tensors = await offload(
        state,
        local_checkpoint.pull,
        local,
        vdir.parent,
        body.target_version,
        Path(base),
        root=weights_root(state),
    )
    what = "seeded" if body.target_version == 0 else f"{versions} version(s) applied to"
    return UpdateWeightsResponse(
        success=True,
        message=f"Succeeded: local checkpoint {what} at version {body.target_version}.",
        tensors_loaded=tensors,
        model_dir=str(local),
        elapsed_ms=(time.perf_counter() - t0) * 1000,
    )


delta_router = Router(
    path="/", guards=[weight_update_guard], opt=SGLANG_ERRORS, route_handlers=[pull_weights]
)
