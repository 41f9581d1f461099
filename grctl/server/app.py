"""create_app(engine, config): the Litestar app; its lifespan starts and stops the engine.

app.state holds what handlers share:
  engine        the Engine (started on start-up, drained and stopped on shutdown)
  config        the ServeConfig
  model_path    what /server_info and /model_info report (a disk update changes it)
  tokenizer     the checkpoint's tokenizer, or None (then `text` in a body is a 400)
  metrics       the Metrics registry /metrics renders
  waiters       the thread limiter for engine calls that wait (generate, result, flush)
  updater       the WeightUpdater: one update at a time, and the update session; it owns the
                labels and counters (updater.versions, /status "weights")
  weights_checker  the snapshot kept by /weights_checker
  beam_groups   the multi-stage groups verl-GR reads one beam_index at a time (beam_groups.py)
  staged        the multi-stage requests by rid: /submit's kept for /result, /generate's while
                they run, both for /abort_request (staged_runs.py)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
from anyio import to_thread
from litestar import Litestar
from litestar.datastructures import State

from grctl.catalog.store import CatalogStore
from grctl.config import ServeConfig
from grctl.model.builtin import DEFAULT_MODEL_NAME
from grctl.server.auth import api_key_guard
from grctl.server.beam_groups import BeamGroups
from grctl.server.body import StrictJSONRequest
from grctl.server.engine_metrics import EngineCollector
from grctl.server.exceptions import EXCEPTION_HANDLERS
from grctl.server.limits import BodyLimitMiddleware
from grctl.server.metrics import Metrics, MetricsMiddleware, install_log_filter
from grctl.server.openapi import openapi_config, swagger_assets
from grctl.server.router import router_membership
from grctl.server.routes.catalog import catalog_routes
from grctl.server.routes.delta import delta_router
from grctl.server.routes.generate import generate_routes
from grctl.server.routes.info import info_routes
from grctl.server.routes.loads import loads_routes
from grctl.server.routes.memory import memory_router
from grctl.server.routes.openai import openai_routes
from grctl.server.routes.profile import profile_routes
from grctl.server.routes.unsupported import unsupported_routes
from grctl.server.routes.updates import update_router
from grctl.server.routes.weights import weight_router
from grctl.server.staged_runs import StagedRuns
from grctl.server.tokenizer import load_tokenizer
from grctl.weights.checker import WeightsChecker
from grctl.weights.updater import WeightUpdater

log = logging.getLogger("grctl.server")

DRAIN_TIMEOUT_S = 30.0


@asynccontextmanager
async def engine_lifespan(app: Litestar) -> AsyncIterator[None]:
    engine = app.state.engine
    await to_thread.run_sync(engine.start)
    try:
        yield
    finally:
        # uvicorn has already let open requests finish; drain what is still queued, then stop.
        log.info("stopping: draining %d requests", engine.num_in_flight())
        await to_thread.run_sync(partial(engine.stop, drain=True, timeout=DRAIN_TIMEOUT_S))


def create_app(engine: Any, config: ServeConfig, tokenizer: Any | None = None) -> Litestar:
    """The grctl HTTP app over an engine that is not started yet; the lifespan starts it."""
    metrics = Metrics(config.served_model_name or config.engine.model_path or DEFAULT_MODEL_NAME)
    if engine.catalogs is None:  # reloads need a store even when none was loaded at start
        engine.catalogs = CatalogStore(
            engine.device,
            engine.model.config.vocab_size,
            max_bytes=config.max_catalog_bytes,
            root=config.weights_root,
        )
    if tokenizer is None:
        tokenizer = load_tokenizer(config.engine.model_path)
    state = State(
        {
            "engine": engine,
            "config": config,
            "model_path": config.engine.model_path or DEFAULT_MODEL_NAME,
            "tokenizer": tokenizer,
            "metrics": metrics,
            "updater": WeightUpdater(engine),
            "weights_checker": WeightsChecker(),
            "beam_groups": BeamGroups(config.beam_group_max_bytes, config.beam_group_ttl_s),
            "staged": StagedRuns(
                config.engine.max_waiting_requests,
                config.engine.max_finished_results,
                config.engine.max_finished_result_bytes or None,
            ),
            # One thread per waiting call; enough that every queued request can be awaited.
            "waiters": anyio.CapacityLimiter(
                config.engine.max_running_requests + config.engine.max_waiting_requests + 8
            ),
        }
    )
    metrics.add_collector(EngineCollector(state))
    install_log_filter(metrics)
    return Litestar(
        route_handlers=[
            *generate_routes,
            *info_routes,
            *loads_routes,
            weight_router,
            update_router,
            delta_router,
            memory_router,
            *catalog_routes,
            *openai_routes,
            *profile_routes,
            *unsupported_routes,
            swagger_assets(),
        ],
        lifespan=[engine_lifespan, router_membership],
        state=state,
        guards=[api_key_guard],
        middleware=[
            MetricsMiddleware(metrics, config.log_requests),
            BodyLimitMiddleware(config.max_http_request_bytes),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        request_class=StrictJSONRequest,
        request_max_body_size=None,  # BodyLimitMiddleware is the one place the limit lives
        openapi_config=openapi_config(),
        logging_config=None,  # `grctl serve` configures logging once (server/logs.py)
        debug=False,
    )
