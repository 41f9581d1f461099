"""The weight-sync and memory routes' bodies and replies (docs/http-api.md "Weight sync").

`weight_version` arrives as an int or a str (slime sends ints) and is kept as a str.
"""

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

Version = str | int | float | None
DEFAULT_GROUP = "weight_update_group"  # SGLang's default process-group name
# SGLang's runner selectors that name grctl's one model (it has no draft model).
SELECTORS = ("all", "target")


def version_str(v: Version) -> str | None:
    """weight_version as sent (int or str) -> the str kept; None means keep the old one.
    An integral float is its int: 7.0 and 7 name the same version."""
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)


class PauseBody(Struct, kw_only=True):
    mode: str = "abort"  # abort | retract | in_place


class PauseResponse(Struct, kw_only=True):
    paused: bool = True
    mode: str = "abort"
    num_aborted_requests: int = 0


class ContinueResponse(Struct, kw_only=True):
    paused: bool = False


class WeightVersionResponse(Struct, kw_only=True):
    weight_version: str = ""
    token_step: int | str | None = None
    weight_update_count: int = 0
    weights_mixed: bool = False  # the tensors carry more than one label
    label_counts: dict[str, int] = msgspec.field(default_factory=dict)  # label -> HF tensors
    weights_torn: bool = False  # a failed copy left tensors that no later write repaired
    torn_tensors: list[str] = msgspec.field(default_factory=list)  # those HF tensors
    # HF tensors a memory release dropped (no host backup), until the trainer writes them
    discarded_tensors: list[str] = msgspec.field(default_factory=list)


class StatusWeights(WeightVersionResponse, kw_only=True):
    """The `weights` section of GET /status: /get_weight_version's keys and one more."""

    last_weight_update_ms: float | None = None


class BeginWeightUpdateBody(Struct, kw_only=True):
    selector: str = "all"  # SGLang's runner selector: one of SELECTORS
    catalog_path: str | None = None  # the catalog of the session's weights, installed at its end


class UpdateWeightVersionBody(Struct, kw_only=True):
    new_version: Version = None
    abort_all_requests: bool = False


class UpdateWeightVersionResponse(Struct, kw_only=True):
    success: bool = True
    new_version: str = ""
    message: str = ""


class GetWeightsBody(Struct, kw_only=True):
    name: str | None = None
    truncate_size: Annotated[int, Meta(ge=1)] = 100


class GetWeightsResponse(Struct, kw_only=True):
    parameter: Any = None  # nested lists of floats, truncated along dim 0


class WeightsCheckerBody(Struct, kw_only=True):
    action: str = "checksum"  # snapshot | reset_tensors | compare | checksum (SGLang's default)
    allow_quant_error: bool = False  # grctl holds no quantized weights: compare is exact
    skip_tensor_list: list[str] | None = None  # name substrings left out of reset/compare/checksum
    selector: str = "all"  # one of SELECTORS


class TensorChecksum(Struct, kw_only=True):
    sha256: str = ""
    dtype: str = ""
    shape: list[int] = msgspec.field(default_factory=list)


class ParallelismRole(Struct, kw_only=True):
    """One runner's place in SGLang's parallelism: grctl's one model on its one rank."""

    role: str = "target"
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    rank: int = 0
    size: int = 1


class RankChecksums(Struct, kw_only=True):
    """SGLang's per-rank checksum record (miles' checksum reader takes these from `ranks`)."""

    checksums: dict[str, str] = msgspec.field(default_factory=dict)  # HF name -> sha256 hex
    per_gpu_checksum: str = ""  # sha256 over the sorted (name, checksum) pairs
    parallelism_info: list[ParallelismRole] = msgspec.field(default_factory=list)


class WeightsCheckerResponse(Struct, kw_only=True):
    success: bool = True
    message: str = ""
    weight_version: str | None = None
    algorithm: str | None = None
    tensors: dict[str, TensorChecksum] = msgspec.field(default_factory=dict)  # checksum only
    # checksum only, SGLang 0.5.23's shape: one entry per rank (one here), and their digest
    ranks: list[RankChecksums] | None = None
    per_engine_checksum: str | None = None


class StrictWeightsCheckerResponse(WeightsCheckerResponse, kw_only=True, omit_defaults=True):
    """What the server sends: `success` always, the rest only when set."""

    success: bool


class UpdateFromDiskBody(Struct, kw_only=True):
    model_path: str | None = None
    model_dir: str | None = None  # alias of model_path
    weight_version: Version = None
    token_step: int | str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    catalog_path: str | None = None  # a catalog JSONL that goes with these weights
    load_format: str | None = None


class UpdateFromTensorBody(Struct, kw_only=True):
    serialized_named_tensors: list[Any] | None = None  # one entry per TP rank; entry 0 is ours
    load_format: str | None = None  # flattened_bucket | direct | None
    selector: str = "all"  # one of SELECTORS
    weight_version: Version = None
    token_step: int | str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    catalog_path: str | None = None  # a catalog JSONL that goes with these weights


class UpdateWeightsResponse(Struct, kw_only=True):
    success: bool = True
    message: str = ""
    tensors_loaded: int = 0
    flushed_cache: bool = False
    num_aborted_requests: int = 0
    weight_version: str | None = None
    token_step: int | str | None = None
    elapsed_ms: float = 0.0
    model_dir: str | None = None
    catalog_version: int | None = None  # with catalog_path: the catalog installed with them


class InitGroupBody(Struct, kw_only=True):
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int | None = None
    world_size: int | None = None
    group_name: str = DEFAULT_GROUP
    backend: str | None = None


class UpdateFromDistributedBody(Struct, kw_only=True):
    names: list[str] = msgspec.field(default_factory=list)
    dtypes: list[str] = msgspec.field(default_factory=list)
    shapes: list[list[int]] = msgspec.field(default_factory=list)
    group_name: str = DEFAULT_GROUP
    load_format: str | None = None
    selector: str = "all"  # one of SELECTORS
    weight_version: Version = None
    token_step: int | str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    catalog_path: str | None = None  # a catalog JSONL that goes with these weights


class DestroyGroupBody(Struct, kw_only=True):
    group_name: str = DEFAULT_GROUP


class SuccessResponse(Struct, kw_only=True):
    success: bool = True
    message: str = ""


class MemoryBody(Struct, kw_only=True):
    tags: list[str] | None = None  # kv_cache | weights | cuda_graph; null or []: all


class MemoryResponse(Struct, kw_only=True):
    success: bool = True
    message: str = ""
    released: list[str] = msgspec.field(default_factory=list)  # still released after the call


class PullWeightsBody(Struct, kw_only=True):
    """/pull_weights (miles' disk-delta name): apply `source_dir/weight_v{target_version:06d}`,
    a delta against the served weights, in place; or, with `local_checkpoint_dir`, onto that
    host-local checkpoint (target_version 0 seeds it), writing no served weight."""

    source_dir: str | None = None
    target_version: Annotated[int, Meta(ge=0, le=999_999)] | None = None
    local_checkpoint_dir: str | None = None  # miles' form: patch this checkpoint dir instead
    weight_version: Version = None  # the label after the delta; default str(target_version)
    flush_cache: bool = True
    abort_all_requests: bool = False
    catalog_path: str | None = None
    token_step: int | str | None = None
