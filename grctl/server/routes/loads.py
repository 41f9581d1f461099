"""GET /loads and /v1/loads: the load snapshot SGLang 0.5.23 serves at /v1/loads, which gateways
(smg reads /loads first, then /v1/loads) and slime's abort loop read.

One rank (dp_rank 0). Figures grctl keeps are reported in SGLang's units (KV in tokens of the
served model's layout, memory in GiB); those it does not keep (generation throughput,
utilization, prefill busy time, the tokens of queued prompts) are 0 (docs/http-api.md).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from functools import lru_cache
from typing import Annotated

import msgspec
import torch
from litestar import Response, get
from litestar.datastructures import State
from litestar.enums import MediaType
from litestar.params import Parameter, QueryParameter

import grctl
from grctl.errors import ValidationError
from grctl.protocol.info import Load, LoadDisaggregation, LoadMemory, LoadQueues, LoadsResponse

SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
FORMATS = ("json", "prometheus")
# the sections grctl reports, as `include` names them: the Load field they fill
FILLED = {"memory": "memory", "disagg": "disaggregation", "queues": "queues"}
# Prometheus names of a section's samples (SGLang's prefixes)
PROM_PREFIX = {"disaggregation": "disagg"}
GIB = float(1 << 30)


@lru_cache(maxsize=4)
def accelerator_name(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.get_device_name(device)
    except Exception:  # a name is a courtesy; the load figures stand without it
        return None


def included(include: str | None) -> set[str]:
    """The sections `include` asks for (SGLang: comma separated, none or empty for all)."""
    if not include:
        return set(FILLED)
    asked = {part.strip() for part in include.split(",")}
    unknown = sorted(asked - set(SECTIONS))
    if unknown:
        raise ValidationError(
            f"include names unknown sections: {', '.join(unknown)}",
            hint=f"send a comma-separated list of {', '.join(SECTIONS)}",
        )
    return set(FILLED) if "all" in asked else asked & set(FILLED)


def rss_bytes() -> int:
    """This process's resident set (Linux's /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def snapshot(state: State, sections: set[str]) -> Load:
    """This server's load now: one read of the engine's status, under its lock."""
    engine = state.engine
    status = engine.status()
    sched, reqs = status["scheduler"], status["requests"]
    cfg = engine.model.config
    weight = next(engine.model.parameters())
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * weight.element_size()
    held = sched["context_kv_bytes"] + sched["beam_kv_bytes"]
    used = held // per_token
    budget = sched["kv_bytes_budget"]
    capacity = budget // per_token if budget else 0
    in_flight = sched["num_running"] + sched["num_waiting"]
    prompt, cached = reqs["prompt_tokens"], reqs["cached_tokens"]
    load = Load(
        timestamp=time.time(),
        num_running_reqs=sched["num_running"],
        num_waiting_reqs=sched["num_waiting"],
        num_used_tokens=used,
        num_total_tokens=used,
        num_active_tokens=used,
        max_total_num_tokens=capacity,
        max_running_requests=sched["max_running_requests"],
        token_usage=round(min(1.0, sched["kv_bytes_admitted"] / budget), 4) if budget else 0.0,
        cache_hit_rate=round(cached / prompt, 4) if prompt else 0.0,
        total_prefill_uncached_tokens=prompt - cached,
    )
    if "memory" in sections:
        # a released parameter's data is an empty tensor: what is resident now
        resident = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        load.memory = LoadMemory(
            weight_gb=round(resident / GIB, 3),
            kv_cache_gb=round(held / GIB, 3),
            token_capacity=capacity,
            host_rss_gb=round(rss_bytes() / GIB, 3),
            weight_host_backup_gb=round(
                status["engine"]["memory"]["offloaded_weight_bytes"] / GIB, 3
            ),
        )
    if "disagg" in sections:
        load.disaggregation = LoadDisaggregation()
    if "queues" in sections:
        paused = in_flight if sched["paused"] else 0
        load.queues = LoadQueues(waiting=sched["num_waiting"], paused=paused)
    return load


def prometheus(load: Load) -> str:
    """SGLang's text form: one gauge per number, `sglang_<key>{dp_rank="0"}`."""
    lines = []
    for key, value in msgspec.structs.asdict(load).items():
        if key in ("dp_rank", "decode_moments") or value is msgspec.UNSET:
            continue
        samples = [(key, value)]
        if isinstance(value, msgspec.Struct):
            prefix = PROM_PREFIX.get(key, key)
            samples = [(f"{prefix}_{k}", v) for k, v in msgspec.structs.asdict(value).items()]
        for name, v in samples:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                lines += [f"# TYPE sglang_{name} gauge", f'sglang_{name}{{dp_rank="0"}} {v}']
    return "\n".join(lines) + "\n"


@get(
    ["/loads", "/v1/loads"],
    summary="Load of this server's one rank, in SGLang's /v1/loads shape",
)
async def loads(
    state: State,
    include: str | None = Parameter(default=None, description="core,memory,queues,disagg,all"),
    dp_rank: int | None = Parameter(default=None, description="only this rank (0 is the one)"),
    fmt: Annotated[str | None, QueryParameter(name="format", description="json|prometheus")] = None,
    model: str | None = Parameter(default=None, description="accepted (smg's); one model"),
) -> Response:
    sections = included(include)
    if fmt is not None and fmt not in FORMATS:
        raise ValidationError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    rows = [] if dp_rank not in (None, 0) else [snapshot(state, sections)]
    if fmt == "prometheus":
        text = "".join(prometheus(row) for row in rows) or "\n"
        return Response(text, media_type=MediaType.TEXT)
    body = LoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(),
        version=grctl.__version__,
        accelerator=accelerator_name(next(state.engine.model.parameters()).device),
        loads=rows,
    )
    return Response(body)


loads_routes = [loads]
