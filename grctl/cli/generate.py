"""`grctl generate` (the engine without a server, one request) and `grctl model export`.

The engine and the weights are imported inside the functions: they bring torch, which the
other commands and --help do without.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer

from grctl.cli.output import console

model_app = typer.Typer(help="The built-in default model.", no_args_is_help=True)


def generate(
    input_ids: Annotated[str, typer.Argument(help="Prompt token ids, comma-separated.")],
    model_path: Annotated[
        Optional[Path], typer.Option(help="HF checkpoint dir; none: the built-in model.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 3,
    n: Annotated[int, typer.Option(min=1, help="Beam width (1: greedy).")] = 1,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """Generate offline (no server) from token ids and print the sequences."""
    try:
        ids = [int(t) for t in input_ids.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise typer.BadParameter("input ids must be integers separated by commas") from exc
    for line in generate_offline(model_path, ids, max_new_tokens, n, device):
        typer.echo(line)  # tab-separated as made: rich would expand the tabs


@model_app.command("export")
def model_export(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the HF checkpoint into.")],
) -> None:
    """Write the built-in model as an HF checkpoint (config.json + model.safetensors)."""
    from grctl.weights.loader import export_hf, load_model

    path = export_hf(load_model(None), out_dir)
    console.print(f"wrote the built-in model to {path}")


def generate_offline(
    model_path: Path | None, input_ids: list[int], max_new_tokens: int, n: int, device: str
) -> Iterator[str]:
    """Lines to print: each beam's output ids and score (n == 1: the greedy sequence)."""
    from grctl.engine.config import EngineConfig
    from grctl.engine.engine import Engine
    from grctl.engine.request import GenerateRequest, SamplingParams
    from grctl.model.device import resolve_device
    from grctl.weights.loader import load_model

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
