"""SGLang's profiling routes: /start_profile and /stop_profile (torch's profiler over engine
steps, engine/profiler.py), behind the API key like every other route.

The body (or, on GET, the query) is SGLang's ProfileReq; numbers may be strings, as
`sglang.bench_serving --profile` sends them. Traces go under --torch-profiler-dir
(GR_TORCH_PROFILER_DIR, or SGLANG_TORCH_PROFILER_DIR; default: the temp dir), the profile
root: a body's output_dir is a directory inside it (relative to it, or an absolute path that
resolves inside it); `..`, a symlink out of it or any other absolute path is a 400, so no
request can make the server write elsewhere.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import msgspec
from litestar import Request, route
from litestar.datastructures import State

from grctl.engine.profiler import ProfileRequest
from grctl.errors import ValidationError
from grctl.protocol.profile import ProfileBody, ProfileResponse
from grctl.server import logs
from grctl.server.offload import offload
from grctl.server.params import merged_params

MAX_NAME = 128  # a profile id or prefix; the trace's file name stays under 255 bytes
NAME = re.compile(r"[A-Za-z0-9._+=-]+")


def file_part(value: str, what: str) -> str:
    """A profile id or prefix becomes part of a file name: one plain path segment."""
    if len(value) > MAX_NAME:
        raise ValidationError(f"{what} is {len(value)} characters; at most {MAX_NAME}")
    if not NAME.fullmatch(value) or value in (".", ".."):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ValidationError(
            f"{what} {shown!r} cannot be part of a file name",
            hint="use letters, digits and . _ + = -",
        )
    return value


def confined(root: str, output_dir: str | None) -> str:
    """output_dir inside the profile root (the root when none is given): a 400 otherwise."""
    base = Path(root).resolve()
    if not output_dir:
        return str(base)
    if "\x00" in output_dir or len(output_dir) > 4096:
        raise ValidationError("output_dir is not a usable path")
    given = Path(output_dir)
    if ".." in given.parts:
        raise ValidationError("output_dir may not contain '..'")
    target = (given if given.is_absolute() else base / given).resolve()  # follows symlinks
    if target != base and base not in target.parents:
        raise ValidationError(
            f"output_dir must be inside the profile directory {str(base)!r}",
            hint="send a path relative to it, or start the server with --torch-profiler-dir",
        )
    return str(target)


def profile_request(state: State, body: ProfileBody) -> ProfileRequest:
    if body.profile_by_stage or body.profile_stages:
        raise ValidationError(
            "grctl profiles whole engine steps, not prefill and decode apart",
            hint="send profile_by_stage false and no profile_stages",
        )
    root = state.config.torch_profiler_dir or tempfile.gettempdir()
    return ProfileRequest(
        output_dir=confined(root, body.output_dir),
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
