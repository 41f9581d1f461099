"""ServeConfig: everything `grctl serve` was told, built once from flags and GR_* variables."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20

# Each ServeConfig field is also a GR_* environment variable (typer reads them for `grctl serve`);
# the API key keeps its historical name.
ENV_PREFIX = "GR_"
ENV_OVERRIDES = {"api_key": "GR_HTTP_API_KEY"}


def env_var(field_name: str) -> str:
    return ENV_OVERRIDES.get(field_name, ENV_PREFIX + field_name.upper())


@dataclass(frozen=True)
class ServeConfig:
    model_path: str | None = None  # None: the built-in model
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (the checkpoint's) | bfloat16 | float16 | float32
    api_key: str | None = None
    max_http_request_bytes: int = MiB
    max_http_submit_many: int = 32
    max_running_requests: int = 64
    max_waiting_requests: int = 1024
    max_context_len: int = 8192
    max_beam_width: int = 256
    max_new_tokens: int = 64  # the largest sampling_params.max_new_tokens accepted
    enable_prefill_cache: bool = False
    prefill_cache_max_entries: int = 64
    prefill_cache_max_tokens: int = 262144
    use_cuda_graph: bool = True
    allow_weight_update: bool = False
    weight_version: str = "default"
    weights_root: str | None = None  # where disk updates may read from (None: anywhere)
    log_requests: bool = False  # one JSON line per HTTP request on stderr
    generate_timeout_s: float = 300.0  # /generate answers 504 generate_timeout after this

    def __post_init__(self) -> None:
        from grctl.errors import ValidationError

        positive = (
            "port",
            "max_http_request_bytes",
            "max_http_submit_many",
            "max_running_requests",
            "max_waiting_requests",
            "max_context_len",
            "max_beam_width",
            "max_new_tokens",
            "prefill_cache_max_entries",
            "prefill_cache_max_tokens",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValidationError(f"{name} must be positive, got {getattr(self, name)}")
        if self.generate_timeout_s <= 0:
            raise ValidationError("generate_timeout_s must be positive")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValidationError(
                f"unsupported dtype {self.dtype!r}; use auto, bfloat16, float16 or float32"
            )
        if self.api_key == "":  # an empty GR_HTTP_API_KEY means no auth, not "key is empty"
            object.__setattr__(self, "api_key", None)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
