"""The profiling routes' body and reply (docs/http-api.md "Profiling"): SGLang's ProfileReq.

Numbers may come as strings (`sglang.bench_serving --profile-steps 5` sends "5").
"""

from typing import Annotated

from msgspec import Meta, Struct

Count = Annotated[int, Meta(ge=0)]


class ProfileBody(Struct, kw_only=True):
    output_dir: str | None = None  # default: --torch-profiler-dir, else the temp dir
    start_step: Count | None = None  # start once the engine has run this many steps
    num_steps: Annotated[int, Meta(ge=1)] | None = None  # then stop by itself after this many
    activities: list[str] | None = None  # CPU, GPU, MEM; default CPU and GPU
    with_stack: bool | None = None  # default true
    record_shapes: bool | None = None  # default true
    profile_id: str | None = None  # default: the time the profile was asked for
    profile_prefix: str | None = None
    # SGLang's per-stage and multi-rank options: grctl profiles whole steps on one rank.
    profile_by_stage: bool = False
    profile_stages: list[str] | None = None
    merge_profiles: bool = False
    detailed_annotations: bool = False


class ProfileResponse(Struct, kw_only=True):
    success: bool = True
    message: str = ""
    trace_path: str | None = None  # where the trace is (or will be) written
