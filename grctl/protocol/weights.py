"""msgspec Structs for the weight-sync bodies (docs/http-api.md "Weight sync").

Unknown keys are ignored; Litestar converts with strict=False, so "7" is read where an int is
expected. `weight_version` arrives as int or str and is kept as a str.
No `from __future__ import annotations`: msgspec reads these annotations at runtime.
"""

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

Version = str | int | float | None


class PauseBody(Struct, kw_only=True):
    mode: str = "abort"  # abort | retract | in_place


class PauseResponse(Struct, kw_only=True):
    paused: bool
    mode: str
    num_aborted_requests: int


class ContinueResponse(Struct, kw_only=True):
    paused: bool


class WeightVersionResponse(Struct, kw_only=True):
    weight_version: str
    token_step: int | str | None
    weight_update_count: int
    weights_mixed: bool = False  # the tensors carry more than one label
    label_counts: dict[str, int] = msgspec.field(default_factory=dict)  # label -> HF tensors


class BeginWeightUpdateBody(Struct, kw_only=True):
    selector: str = "all"  # SGLang's runner selector; grctl serves one model, so only "all"


class UpdateWeightVersionBody(Struct, kw_only=True):
    new_version: Version = None
    abort_all_requests: bool = False


class UpdateWeightVersionResponse(Struct, kw_only=True):
    success: bool
    new_version: str
    message: str


class GetWeightsBody(Struct, kw_only=True):
    name: str | None = None
    truncate_size: Annotated[int, Meta(ge=1)] = 100


class GetWeightsResponse(Struct, kw_only=True):
    parameter: Any  # nested lists of floats, truncated along dim 0


class WeightsCheckerBody(Struct, kw_only=True):
    action: str | None = None  # snapshot | reset_tensors | compare | checksum


class TensorChecksum(Struct, kw_only=True):
    sha256: str
    dtype: str
    shape: list[int]


class WeightsCheckerResponse(Struct, kw_only=True, omit_defaults=True):
    success: bool
    message: str = ""
    weight_version: str | None = None
    algorithm: str | None = None
    tensors: dict[str, TensorChecksum] | None = None


class UpdateFromDiskBody(Struct, kw_only=True):
    model_path: str | None = None
    model_dir: str | None = None  # alias of model_path
    weight_version: Version = None
    token_step: int | str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None


class UpdateFromTensorBody(Struct, kw_only=True):
    serialized_named_tensors: list[Any] | None = None  # one entry per TP rank; entry 0 is ours
    load_format: str | None = None  # flattened_bucket | direct | None
    weight_version: Version = None
    token_step: int | str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateWeightsResponse(Struct, kw_only=True):
    success: bool
    message: str
    tensors_loaded: int
    flushed_cache: bool
    num_aborted_requests: int
    weight_version: str
    token_step: int | str | None
    elapsed_ms: float
    model_dir: str | None = None


class InitGroupBody(Struct, kw_only=True):
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int | None = None
    world_size: int | None = None
    group_name: str = "weight_update_group"
    backend: str | None = None


class UpdateFromDistributedBody(Struct, kw_only=True):
    names: list[str] = msgspec.field(default_factory=list)
    dtypes: list[str] = msgspec.field(default_factory=list)
    shapes: list[list[int]] = msgspec.field(default_factory=list)
    group_name: str = "weight_update_group"
    load_format: str | None = None
    weight_version: Version = None
    token_step: int | str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class DestroyGroupBody(Struct, kw_only=True):
    group_name: str = "weight_update_group"


class SuccessResponse(Struct, kw_only=True):
    success: bool
    message: str


def version_str(v: Version) -> str | None:
    """weight_version as sent (int or str) -> the str we keep; None means keep the old one."""
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)
