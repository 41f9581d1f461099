"""What the client returns: one msgspec Struct per reply of docs/http-api.md.

Every field has a default, so the same Structs read replies from grctl and from SGLang itself
(which omits grctl's extra keys); unknown keys are ignored. No `from __future__ import
annotations`: msgspec reads these annotations at runtime.
"""

from typing import Any

import msgspec
from msgspec import Struct

Version = str | int | None


class FinishReason(Struct, kw_only=True):
    type: str = ""  # "length" | "stop" | "item_complete" | "abort"
    matched: int | None = None
    length: int | None = None


class BeamMetaInfo(Struct, kw_only=True):
    sequence_score: float = 0.0
    finish_reason: FinishReason | None = None


class BeamResult(Struct, kw_only=True):
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: BeamMetaInfo = msgspec.field(default_factory=BeamMetaInfo)


class ItemResult(Struct, kw_only=True):
    """One beam read against the server's item catalog (grctl only)."""

    rank: int = 0
    token_ids: list[int] = msgspec.field(default_factory=list)
    item_ids: list[int | str] = msgspec.field(default_factory=list)  # several: a collision
    item_id: int | str | None = None  # the first of item_ids
    is_complete: bool = False  # the beam's tokens spell a whole item path
    score: float = 0.0


class MetaInfo(Struct, kw_only=True):
    id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason = msgspec.field(default_factory=FinishReason)
    weight_version: str = ""
    weight_versions: list[str] = msgspec.field(default_factory=list)
    beam_width: int = 1
    beam_results: list[BeamResult] = msgspec.field(default_factory=list)
    e2e_latency: float = 0.0
    output_token_logprobs: list[Any] | None = None  # [logprob, token_id, text] per token
    item_results: list[ItemResult] | None = None  # with a catalog: one per beam, in beam order
    catalog_version: int | None = None  # the catalog version the request was served with


class GenerateResult(Struct, kw_only=True):
    text: str = ""
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: MetaInfo = msgspec.field(default_factory=MetaInfo)


class Submitted(Struct, kw_only=True):
    request_id: str


class SubmittedMany(Struct, kw_only=True):
    request_ids: list[str] = msgspec.field(default_factory=list)


class PollResult(Struct, kw_only=True):
    ready: bool = False
    response: GenerateResult | None = None


class CancelResult(Struct, kw_only=True):
    request_id: str = ""
    cancelled: bool = False


class AbortResult(Struct, kw_only=True):
    success: bool = True
    num_aborted_requests: int = 0


class Health(Struct, kw_only=True):
    ok: bool = True


class Readiness(Struct, kw_only=True):
    ready: bool = False
    reasons: list[str] = msgspec.field(default_factory=list)
    paused: bool = False
    weight_version: str = ""
    num_in_flight: int = 0


class ServerInfo(Struct, kw_only=True):
    model_path: str = ""
    weight_version: str = ""
    device: str = "cpu"  # grctl's own keys: where pushed tensors must be staged ...
    gpu_uuid: str | None = None  # ... on which GPU, whatever this process numbers it
    dtype: str = ""  # the served dtype; "" when the server does not say (SGLang)
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    enable_memory_saver: bool = False
    served_model_name: str = ""
    allow_weight_update: bool = False
    version: str = ""


class ModelInfo(Struct, kw_only=True):
    model_path: str = ""
    served_model_name: str = ""
    weight_version: str = ""
    is_generation: bool = True
    tokenizer_path: str | None = None
    vocab_size: int = 0
    model_config: dict[str, Any] | None = None  # the served structure, as an HF config.json


class MemoryResult(Struct, kw_only=True):
    success: bool = True
    message: str = ""
    released: list[str] = msgspec.field(default_factory=list)  # still released after the call


class FlushResult(Struct, kw_only=True):
    success: bool = True
    entries_cleared: int | None = None
    message: str | None = None


class PauseResult(Struct, kw_only=True):
    paused: bool = True
    mode: str = "abort"
    num_aborted_requests: int = 0


class ContinueResult(Struct, kw_only=True):
    paused: bool = False


class WeightVersion(Struct, kw_only=True):
    weight_version: str = ""
    token_step: int | str | None = None
    weight_update_count: int = 0
    last_weight_update_ms: float | None = None  # only in /status "weights"
    weights_mixed: bool = False  # the served tensors carry more than one label
    label_counts: dict[str, int] = msgspec.field(default_factory=dict)  # label -> tensors


class VersionUpdate(Struct, kw_only=True):
    success: bool = True
    new_version: str = ""
    message: str = ""


class WeightsByName(Struct, kw_only=True):
    parameter: Any = None  # nested lists of floats, truncated along dim 0


class TensorChecksum(Struct, kw_only=True):
    sha256: str
    dtype: str = ""
    shape: list[int] = msgspec.field(default_factory=list)


class CheckerResult(Struct, kw_only=True):
    success: bool = True
    message: str = ""
    weight_version: str | None = None
    algorithm: str | None = None
    tensors: dict[str, TensorChecksum] = msgspec.field(default_factory=dict)


class UpdateResult(Struct, kw_only=True):
    success: bool = True
    message: str = ""
    model_dir: str | None = None
    tensors_loaded: int = 0
    flushed_cache: bool = False
    num_aborted_requests: int = 0
    weight_version: str | None = None
    token_step: int | str | None = None
    elapsed_ms: float = 0.0


class SuccessResult(Struct, kw_only=True):
    success: bool = True
    message: str = ""


class Status(Struct, kw_only=True):
    """GET /status: `weights` typed; the engine's sections (scheduler, cache...) as sent."""

    weights: WeightVersion = msgspec.field(default_factory=WeightVersion)
    sections: dict[str, Any] = msgspec.field(default_factory=dict)


class CatalogStatus(Struct, kw_only=True):
    loaded: bool = False
    version: int | None = None
    num_items: int = 0
    num_paths: int = 0
    max_depth: int = 0
    nbytes: int = 0
    source: str | None = None
    loaded_at: float | None = None
    num_nodes: int = 0
    num_collision_paths: int = 0
    num_shadowed_items: int = 0
    previous_version: int | None = None
    num_reloads: int = 0
    num_rollbacks: int = 0


def version_str(v: Version) -> str | None:
    """weight_version as the wire keeps it: a str, or None for "keep the old one"."""
    return None if v is None else str(v)
