"""ServeConfig: everything `grctl serve` was told, built once from flags and GR_<FLAG> variables.

It composes the engine's own EngineConfig (grctl/engine/config.py) and adds what only the HTTP
server uses. Each field is declared once as a knob (grctl/knobs.py): its flag, environment
variable, help line and bounds all come from that declaration.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import Field, dataclass, field
from typing import Any

from grctl.engine.config import EngineConfig
from grctl.knobs import Knob, check_knobs, knob, knobs_of

MiB = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")  # server/logs.py writes each


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = knob("127.0.0.1", "Address to listen on.", "HTTP")
    port: int = knob(8000, "Port to listen on.", "HTTP", min=1)
    api_key: str | None = knob(
        None,
        "Key required (X-GR-API-Key or Bearer) on every route but /health, /ready, /docs, "
        "/openapi.json and /metrics (unless --metrics-auth).",
        "HTTP",
        old_env=("GR_HTTP_API_KEY",),
    )
    max_http_request_bytes: int = knob(MiB, "Largest request body (413 over it).", "HTTP", min=1)
    max_http_submit_many: int = knob(32, "Most requests in one /submit_many.", "HTTP", min=1)
    generate_timeout_s: float = knob(300.0, "/generate answers 504 after this.", "HTTP", min=0.001)
    beam_group_max_bytes: int = knob(
        64 * MiB, "Bytes of multi-stage beam groups kept for beam_index calls.", "HTTP", min=1
    )
    beam_group_ttl_s: float = knob(
        600.0, "Seconds a multi-stage beam group is kept for beam_index calls.", "HTTP", min=0.001
    )
    log_requests: bool = knob(False, "Log one line per request (in --log-format).", "HTTP")
    log_level: str = knob("info", "Server log level.", "HTTP", choices=LOG_LEVELS)
    log_format: str = knob("text", "Server log lines: text or json.", "HTTP", choices=LOG_FORMATS)
    metrics_auth: bool = knob(False, "Require the API key on /metrics too.", "HTTP")
    parallel_sampling: bool = knob(
        False,
        "n without beam_width: n independent samples, SGLang's reading (off: n beams).",
        "HTTP",
    )
    served_model_name: str | None = knob(None, "Name to report; default: the path.", "Model")
    router_url: str | None = knob(None, "sglang-router to join (leave at exit).", "HTTP")
    router_check_interval: float = knob(
        5.0, "Seconds between checks that the router still lists this server.", "HTTP", min=0.1
    )
    torch_profiler_dir: str | None = knob(
        None,
        "Where /start_profile writes traces; default: temp dir.",
        "HTTP",
        old_env=("SGLANG_TORCH_PROFILER_DIR",),
    )
    allow_weight_update: bool = knob(
        False, "Turn on weight-sync routes (else 403).", "Weight updates"
    )
    weights_root: str | None = knob(
        None, "Dir that disk updates and catalogs read from.", "Weight updates"
    )
    catalog: str | None = knob(
        None,
        "Item catalog JSONL: beams decode to its items.",
        "Catalog",
        aliases=("--catalog-jsonl",),
    )
    allow_catalog_reload: bool = knob(
        False, "Turn on /catalog/reload and /rollback (else 403).", "Catalog"
    )
    max_catalog_bytes: int = knob(1 << 30, "Largest catalog file (400 over it).", "Catalog", min=1)
    enable_memory_saver: bool = knob(
        False, "Say enable_memory_saver in /server_info.", "Weight updates"
    )

    def __post_init__(self) -> None:
        check_knobs(self)
        if self.port > 65535:
            from grctl.errors import ValidationError

            raise ValidationError(f"port must be at most 65535, got {self.port}")
        if self.api_key == "":  # an empty GR_API_KEY means no auth, not "the key is empty"
            object.__setattr__(self, "api_key", None)

    @classmethod
    def knobs(cls) -> Iterator[tuple[Field, Knob]]:
        """Every knob `grctl serve` takes: the engine's, then the server's own."""
        yield from knobs_of(EngineConfig)
        yield from knobs_of(cls)

    @classmethod
    def from_flags(cls, values: dict[str, Any]) -> ServeConfig:
        """Build from one value per knob (what `grctl serve` parsed), each to its owner."""
        engine_names = {f.name for f, _ in knobs_of(EngineConfig)}
        engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
        return cls(engine=engine, **{k: v for k, v in values.items() if k not in engine_names})

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
