"""SGLang's profiling routes: /start_profile and /stop_profile (torch's profiler over engine
steps, engine/profiler.py), behind the API key like every other route.

The body (or, on GET, the query) is SGLang's ProfileReq; numbers may be strings, as
`sglang.bench_serving --profile` sends them. Traces go to the body's output_dir, else
--torch-profiler-dir (GR_TORCH_PROFILER_DIR, or SGLANG_TORCH_PROFILER_DIR), else the temp dir.
"""

from __future__ import annotations

import tempfile
import time

import msgspec
from litestar import Request, route
from litestar.datastructures import State

from grctl.engine.profiler import ProfileRequest
from grctl.errors import ValidationError
from grctl.protocol.profile import ProfileBody, ProfileResponse
from grctl.server import logs
from grctl.server.offload import offload
from grctl.server.params import merged_params


def file_part(value: str, what: str) -> str:
    """A profile id or prefix becomes part of a file name: one plain path segment."""
    if not value or "/" in value or "\\" in value or "\x00" in value or value in (".", ".."):
        raise ValidationError(f"{what} {value!r} cannot be part of a file name")
    return value


def profile_request(state: State, body: ProfileBody) -> ProfileRequest:
    if body.profile_by_stage or body.profile_stages:
        raise ValidationError(
            "grctl profiles whole engine steps, not prefill and decode apart",
            hint="send profile_by_stage false and no profile_stages",
        )
    output_dir = body.output_dir or state.config.torch_profiler_dir or tempfile.gettempdir()
    if "\x00" in output_dir:
        raise ValidationError("output_dir contains a NUL byte")
    return ProfileRequest(
        output_dir=output_dir,
        profile_id=file_part(body.profile_id or f"{time.time():.6f}", "profile_id"),
        activities=tuple(body.activities or ("CPU", "GPU")),
        num_steps=body.num_steps,
        start_step=body.start_step,
        with_stack=body.with_stack is not False,
        record_shapes=body.record_shapes is not False,
        prefix=None if body.profile_prefix is None else file_part(body.profile_prefix, "prefix"),
    )


async def read_body(request: Request) -> ProfileBody:
    try:
        return msgspec.convert(await merged_params(request), ProfileBody, strict=False)
    except msgspec.ValidationError as exc:
        raise ValidationError(f"bad profile body: {exc}") from exc


@route(
    "/start_profile",
    http_method=["GET", "POST"],
    status_code=200,
    summary="Start torch's profiler over engine steps (SGLang's ProfileReq body)",
)
async def start_profile(state: State, request: Request) -> ProfileResponse:
    req = profile_request(state, await read_body(request))
    await offload(state, state.engine.profiler.start, req)
    logs.event("profile_start", profile_id=req.profile_id, trace=str(req.trace_path))
    return ProfileResponse(success=True, message="Start profiling.", trace_path=str(req.trace_path))


@route(
    "/stop_profile",
    http_method=["GET", "POST"],
    status_code=200,
    summary="Stop the profiler and write its trace",
)
async def stop_profile(state: State) -> ProfileResponse:
    path = await offload(state, state.engine.profiler.stop)
    logs.event("profile_stop", trace=None if path is None else str(path))
    if path is None:
        return ProfileResponse(success=True, message="Stopped before its start_step: no trace.")
    return ProfileResponse(success=True, message="Stop profiling.", trace_path=str(path))


profile_routes = [start_profile, stop_profile]
