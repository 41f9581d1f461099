"""`grctl serve`: build the model and the engine, then run the app under uvicorn.

uvicorn owns SIGINT/SIGTERM: it stops accepting, lets open requests finish, then runs the
lifespan shutdown, which drains the engine's queue and stops it.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from grctl.config import ServeConfig
from grctl.engine.engine import Engine, EngineConfig
from grctl.server.app import DRAIN_TIMEOUT_S, create_app
from grctl.weights.loader import DEFAULT_MODEL_NAME, load_model, resolve_device

log = logging.getLogger("grctl.server")


def engine_config(config: ServeConfig, device: str) -> EngineConfig:
    return EngineConfig(
        device=device,
        max_context_len=config.max_context_len,
        max_running_requests=config.max_running_requests,
        max_waiting_requests=config.max_waiting_requests,
        max_beam_width=config.max_beam_width,
        max_new_tokens_limit=config.max_new_tokens,
        enable_prefill_cache=config.enable_prefill_cache,
        prefill_cache_max_entries=config.prefill_cache_max_entries,
        prefill_cache_max_tokens=config.prefill_cache_max_tokens,
        use_cuda_graph=config.use_cuda_graph,
    )


def build_engine(config: ServeConfig) -> Engine:
    device = str(resolve_device(config.device))
    model = load_model(config.model_path, device=device, dtype=config.dtype)
    return Engine(model, engine_config(config, device), weight_version=config.weight_version)


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("grctl")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def serve(config: ServeConfig) -> None:
    """Run the server until SIGINT/SIGTERM, then drain and stop."""
    setup_logging()
    engine = build_engine(config)
    app = create_app(engine, config)
    param = next(engine.model.parameters())
    log.info(
        "serving model=%s device=%s dtype=%s weight_version=%s at %s%s",
        config.model_path or DEFAULT_MODEL_NAME,
        param.device,
        str(param.dtype).removeprefix("torch."),
        config.weight_version,
        config.url,
        " (API key required)" if config.api_key else "",
    )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        access_log=False,  # --log-requests writes one JSON line per request instead
        timeout_graceful_shutdown=int(DRAIN_TIMEOUT_S),
        lifespan="on",
    )
