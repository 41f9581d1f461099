"""`grctl serve`: build the model and the engine, then run the app under uvicorn.

uvicorn owns SIGINT/SIGTERM: it stops accepting, lets open requests finish, then runs the
lifespan shutdown, which drains the engine's queue and stops it. Requests a pause holds are
aborted at the signal (GrctlServer), since they could never finish.
"""

from __future__ import annotations

import errno
import gc
import logging
import socket
import threading

import torch
import uvicorn

from grctl import threads
from grctl.config import ServeConfig
from grctl.engine.engine import Engine
from grctl.errors import GrctlError
from grctl.model.builtin import DEFAULT_MODEL_NAME
from grctl.model.dtypes import name_of
from grctl.server import logs
from grctl.server.app import DRAIN_TIMEOUT_S, create_app
from grctl.testing import faults
from grctl.weights.loader import load_model

log = logging.getLogger("grctl.server")


def build_engine(config: ServeConfig) -> Engine:
    """Load the model where config.engine.device says (auto: cuda when available), then the
    engine over it, with the EngineConfig passed whole."""
    cfg = config.engine
    model = load_model(cfg.model_path, device=cfg.device, dtype=cfg.dtype)
    return Engine(model, cfg)


def serve(config: ServeConfig) -> None:
    """Run the server until SIGINT/SIGTERM, then drain and stop."""
    logs.configure(config.log_level, config.log_format)
    faults.install_from_env()  # test hooks: nothing unless a GRCTL_FAULT_* variable is set
    engine = build_engine(config)
    app = create_app(engine, config)
    check_port_free(config.host, config.port)  # before "serving ... at": the port is free
    if config.catalog is not None:
        catalog = engine.catalogs.load(
            config.catalog,
            confine=False,
            weight_version=engine.gate.label,
            weights_generation=engine.gate.generation,
        )
        log.info(
            "catalog %s: %d items, version %d", config.catalog, len(catalog.ids), catalog.version
        )
    param = next(engine.model.parameters())
    log.info(
        "serving model=%s device=%s dtype=%s weight_version=%s at %s%s",
        config.engine.model_path or DEFAULT_MODEL_NAME,
        param.device,
        name_of(param.dtype),
        config.engine.weight_version,
        config.url,
        " (API key required)" if config.api_key else "",
    )
    log.info("threads: torch %d; %s", torch.get_num_threads(), threads.describe())
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        log_config=None,  # uvicorn's loggers write through grctl's handler (server/logs.py)
        access_log=False,  # --log-requests writes one JSON line per request instead
        timeout_graceful_shutdown=int(DRAIN_TIMEOUT_S),
        lifespan="on",
    )
    # Start-up (torch, the model, the app) leaves millions of long-lived objects: collect once
    # and freeze them, so that no request pays a full collection over them (0.5 s, seen as the
    # first request's latency)
    gc.collect()
    gc.freeze()
    server = GrctlServer(uv_config, engine)
    server.run()
    if not server.started:  # uvicorn logged why (a port taken since the check) and gave up
        raise GrctlError(f"the server at {config.url} did not start (see the log above)")


def check_port_free(host: str, port: int) -> None:
    """Bind the address as uvicorn will (SO_REUSEADDR), so a port another server listens on is
    one clear error (the CLI's red line, exit 1) instead of uvicorn's exit 3 after start-up."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise GrctlError(f"cannot listen on {host}:{port}: {exc}", hint="check --host") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            raise GrctlError(
                f"cannot listen on {host}:{port}: " + ("the port is taken" if taken else str(exc)),
                hint="choose another --port, or stop what listens there",
            ) from None


class GrctlServer(uvicorn.Server):
    """uvicorn's server, but a shutdown signal also ends the requests a pause holds.

    Requests frozen by a pause (in_place with their KV, or retracted to the queue) can never
    finish while paused, so uvicorn's graceful drain would wait its whole timeout and then cut
    them off without an answer. Aborting them at the signal answers each with finish_reason
    abort, as pause_generation(abort) would; running requests of an unpaused engine still drain.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if self.engine.gate.is_paused:
            # Not in the signal handler itself: the engine's lock may be held by this thread.
            threading.Thread(target=self.engine.abort_all, daemon=True).start()
        super().handle_exit(sig, frame)
