"""Offline generation for `grctl generate`: the engine without a server, one request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.model.device import resolve_device
from grctl.weights.loader import load_model


def generate_offline(
    model_path: Path | None, input_ids: list[int], max_new_tokens: int, n: int, device: str
) -> Iterator[str]:
    """Lines to print: each beam's output ids and score (n == 1: the greedy sequence)."""
    dev = str(resolve_device(device))
    model = load_model(str(model_path) if model_path else None, device=dev)
    engine = Engine(model, EngineConfig(device=dev, cuda_graph=False))
    engine.start()
    try:
        req = GenerateRequest(tuple(input_ids), SamplingParams(max_new_tokens=max_new_tokens, n=n))
        result = engine.generate(req, timeout=600)
    finally:
        engine.stop(drain=False)
    for rank, beam in enumerate(result.beams):
        yield f"{rank}\t{beam.output_ids}\tscore={beam.sequence_score:.4f}\t{beam.finish_reason}"
