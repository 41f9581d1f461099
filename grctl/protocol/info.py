"""Health, readiness, discovery, /status and /flush_cache replies, the error shape and the
API-key header (docs/http-api.md "Health, status and discovery", "Errors")."""

from typing import Any

import msgspec
from msgspec import Struct

from grctl.protocol.weights import StatusWeights

API_KEY_HEADER = "X-GR-API-Key"  # or `Authorization: Bearer <key>`


class HealthResponse(Struct, kw_only=True):
    ok: bool = True


class ReadyResponse(Struct, kw_only=True):
    ready: bool = False
    reasons: list[str] = msgspec.field(default_factory=list)  # the most decisive first
    paused: bool = False
    weight_version: str = ""
    num_in_flight: int = 0


class LoadMemory(Struct, kw_only=True):
    weight_gb: float = 0.0
    kv_cache_gb: float = 0.0
    graph_gb: float = 0.0
    token_capacity: int = 0
    # grctl's: host memory. The process's resident set, and of it the host copies a weights
    # release keeps (--enable-weights-cpu-backup, --preserve-parameter-names)
    host_rss_gb: float = 0.0
    weight_host_backup_gb: float = 0.0


class LoadDisaggregation(Struct, kw_only=True):
    mode: str = "null"  # grctl serves prefill and decode together
    prefill_bootstrap_queue_reqs: int = 0
    prefill_inflight_queue_reqs: int = 0
    decode_prealloc_queue_reqs: int = 0
    decode_transfer_queue_reqs: int = 0
    decode_retracted_queue_reqs: int = 0
    kv_transfer_speed_gb_s: float = 0.0
    kv_transfer_latency_ms: float = 0.0


class LoadQueues(Struct, kw_only=True):
    waiting: int = 0
    grammar: int = 0
    paused: int = 0
    retracted: int = 0
    prealloc_ready: int = 0


class Load(Struct, kw_only=True):
    """One data-parallel rank's load, SGLang's core keys always, a section when asked for."""

    timestamp: float = 0.0
    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_uncached_tokens: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    num_active_tokens: int = 0
    num_prealloc_ready_tokens: int = 0
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    utilization: float = 0.0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0
    decode_moments: list[float] | None = None
    memory: LoadMemory | msgspec.UnsetType = msgspec.UNSET
    disaggregation: LoadDisaggregation | msgspec.UnsetType = msgspec.UNSET
    queues: LoadQueues | msgspec.UnsetType = msgspec.UNSET


class LoadsResponse(Struct, kw_only=True):
    """GET /loads and /v1/loads: SGLang's /v1/loads reply (one rank: grctl serves on one)."""

    timestamp: str = ""  # ISO 8601, UTC
    version: str = ""
    accelerator: str | None = None  # the GPU's name; null on the CPU
    num_accelerators: int = 1
    loads: list[Load] = msgspec.field(default_factory=list)


class ServerInfo(Struct, kw_only=True):
    model_path: str = ""
    weight_version: str = ""
    # Where it serves and on which device, as SGLang's ServerArgs names them (miles compares
    # each with what it computed for an external engine): one node, one GPU (or the CPU).
    host: str = ""
    port: int = 0
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = 0  # the device index (0 on the CPU)
    gpu_id_step: int = 1
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    num_gpus: int = 1
    enable_memory_saver: bool = False
    disaggregation_mode: str = "null"
    device: str = "cpu"  # grctl's own keys: where pushed tensors must be staged ...
    gpu_uuid: str | None = None  # ... on which GPU, under any CUDA_VISIBLE_DEVICES; null off CUDA
    dtype: str = ""  # the served dtype; "" when the server does not say (SGLang)
    served_model_name: str = ""
    context_length: int = 0
    max_running_requests: int = 0
    max_waiting_requests: int = 0
    max_beam_width: int = 0
    max_new_tokens: int = 0
    enable_prefill_cache: bool = False
    allow_weight_update: bool = False
    version: str = ""


class ParallelismConfig(Struct, kw_only=True):
    """GET /parallelism_config?rank=0 (sglang-miles' fields): one rank serving everything."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_rank: int = 0
    world_size: int = 1
    global_rank: int = 0
    local_rank: int = 0


class ModelInfo(Struct, kw_only=True):
    model_path: str = ""
    weight_version: str = ""
    served_model_name: str = ""
    is_generation: bool = True
    tokenizer_path: str | None = None
    vocab_size: int = 0
    model_config: dict[str, Any] | None = None  # the served structure, as an HF config.json


class ServerStatus(Struct, kw_only=True):
    """GET /status as the client reads it: `weights` typed, every other section as sent (the
    reply itself is one flat object: scheduler, prefill_cache, engine, weights, catalog...)."""

    weights: StatusWeights = msgspec.field(default_factory=StatusWeights)
    sections: dict[str, Any] = msgspec.field(default_factory=dict)


class FlushCacheBody(Struct, kw_only=True):
    timeout: float | None = None  # SGLang's; checked, never waited on (the server answers at once)


class FlushCacheResponse(Struct, kw_only=True):
    success: bool = True
    entries_cleared: int | None = None
    message: str | None = None
    error: dict[str, Any] | None = None  # the error shape, when success is false


class StrictFlushCacheResponse(FlushCacheResponse, kw_only=True, omit_defaults=True):
    """What the server sends: `success` always, the rest only when set."""

    success: bool


class ErrorDetail(Struct, kw_only=True):
    code: str = "internal_error"
    message: str = ""
    retryable: bool = False
    status: int = 500


class ErrorResponse(Struct, kw_only=True):
    """Every error reply; the update routes add SGLang's top-level `success: false, message`."""

    error: ErrorDetail = msgspec.field(default_factory=ErrorDetail)
