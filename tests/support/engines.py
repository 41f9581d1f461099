"""Helpers for in-process engine tests."""

from __future__ import annotations

from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest
from grctl.engine.results import GenerateResult


def run_requests(eng: Engine, reqs: list[GenerateRequest]) -> list[GenerateResult]:
    """Submit every request, step the engine until it is idle, and return their results in
    order."""
    rids = [eng.submit(r) for r in reqs]
    while eng.run_step():
        pass
    return [eng.result(r) for r in rids]
