"""The grctl command line: each command is a thin signature over a plain function."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from grctl.config import ServeConfig, env_var
from grctl.errors import GrctlError

app = typer.Typer(
    name="grctl",
    help="Serve Qwen3 generative-recommendation models and hot-swap their weights.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="The built-in default model.", no_args_is_help=True)
app.add_typer(model_app, name="model")

err_console = Console(stderr=True)
console = Console()


@model_app.command("export")
def model_export(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the HF checkpoint into.")],
) -> None:
    """Write the built-in model as an HF checkpoint (config.json + model.safetensors)."""
    from grctl.weights.loader import export_hf, load_model

    path = export_hf(load_model(None), out_dir)
    console.print(f"wrote the built-in model to {path}")


@app.command()
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
    from grctl.offline import generate_offline

    try:
        ids = [int(t) for t in input_ids.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise typer.BadParameter("input ids must be integers separated by commas") from exc
    for line in generate_offline(model_path, ids, max_new_tokens, n, device):
        console.print(line, highlight=False)


def _opt(field: str, help: str, *decls: str, **kw) -> typer.models.OptionInfo:
    """A `grctl serve` option that also reads its GR_* environment variable."""
    return typer.Option(*decls, envvar=env_var(field), help=help, **kw)


@app.command()
def serve(
    model_path: Annotated[
        Optional[str], _opt("model_path", "HF Qwen3 checkpoint dir; none: the built-in model.")
    ] = None,
    host: Annotated[str, _opt("host", "Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, _opt("port", "Port to listen on.", min=1, max=65535)] = 8000,
    device: Annotated[
        str, _opt("device", "auto (cuda when available), cpu, cuda or cuda:N.")
    ] = "auto",
    dtype: Annotated[
        str, _opt("dtype", "auto (the checkpoint's), bfloat16, float16 or float32.")
    ] = "auto",
    api_key: Annotated[
        Optional[str],
        _opt(
            "api_key",
            "Require this key (X-GR-API-Key or Bearer) on all but /health, /ready.",
            show_default=False,
        ),
    ] = None,
    max_http_request_bytes: Annotated[
        int, _opt("max_http_request_bytes", "Largest request body accepted (413 over it).", min=1)
    ] = 1 << 20,
    max_http_submit_many: Annotated[
        int, _opt("max_http_submit_many", "Most requests one /submit_many may carry.", min=1)
    ] = 32,
    max_running_requests: Annotated[
        int, _opt("max_running_requests", "Requests decoded together.", min=1)
    ] = 64,
    max_waiting_requests: Annotated[
        int, _opt("max_waiting_requests", "Queued requests before 429 overloaded.", min=1)
    ] = 1024,
    max_context_len: Annotated[
        int, _opt("max_context_len", "Longest prompt + output, in tokens.", min=1)
    ] = 8192,
    max_beam_width: Annotated[int, _opt("max_beam_width", "Largest n (beam width).", min=1)] = 256,
    max_new_tokens: Annotated[
        int, _opt("max_new_tokens", "Largest max_new_tokens a request may ask for.", min=1)
    ] = 64,
    enable_prefill_cache: Annotated[
        bool,
        _opt(
            "enable_prefill_cache",
            "Reuse KV of repeated prompt prefixes.",
            "--enable-prefill-cache",
        ),
    ] = False,
    prefill_cache_max_entries: Annotated[
        int, _opt("prefill_cache_max_entries", "Prefill cache size, in prompts.", min=1)
    ] = 64,
    prefill_cache_max_tokens: Annotated[
        int, _opt("prefill_cache_max_tokens", "Prefill cache size, in tokens.", min=1)
    ] = 262144,
    cuda_graph: Annotated[
        bool,
        _opt(
            "use_cuda_graph",
            "Capture decode steps in CUDA graphs (CUDA only).",
            "--cuda-graph/--no-cuda-graph",
        ),
    ] = True,
    allow_weight_update: Annotated[
        bool,
        _opt(
            "allow_weight_update",
            "Turn on the weight-sync routes (off: 403).",
            "--allow-weight-update",
        ),
    ] = False,
    weight_version: Annotated[
        str, _opt("weight_version", "Weight version reported until the first update.")
    ] = "default",
    weights_root: Annotated[
        Optional[str], _opt("weights_root", "Directory disk updates must read from.")
    ] = None,
    log_requests: Annotated[
        bool, _opt("log_requests", "Log one JSON line per HTTP request (stderr).", "--log-requests")
    ] = False,
    generate_timeout_s: Annotated[
        float, _opt("generate_timeout_s", "/generate gives 504 after this many seconds.", min=0.001)
    ] = 300.0,
) -> None:
    """Serve a model over HTTP with SGLang-compatible routes (every flag also reads GR_<FLAG>)."""
    from grctl.server.serve import serve as run_server

    run_server(
        ServeConfig(
            model_path=model_path,
            host=host,
            port=port,
            device=device,
            dtype=dtype,
            api_key=api_key,
            max_http_request_bytes=max_http_request_bytes,
            max_http_submit_many=max_http_submit_many,
            max_running_requests=max_running_requests,
            max_waiting_requests=max_waiting_requests,
            max_context_len=max_context_len,
            max_beam_width=max_beam_width,
            max_new_tokens=max_new_tokens,
            enable_prefill_cache=enable_prefill_cache,
            prefill_cache_max_entries=prefill_cache_max_entries,
            prefill_cache_max_tokens=prefill_cache_max_tokens,
            use_cuda_graph=cuda_graph,
            allow_weight_update=allow_weight_update,
            weight_version=weight_version,
            weights_root=weights_root,
            log_requests=log_requests,
            generate_timeout_s=generate_timeout_s,
        )
    )


def main() -> None:
    """Run the app; a GrctlError prints one red line (a traceback with GRCTL_DEBUG=1)."""
    try:
        app(standalone_mode=True)
    except GrctlError as exc:
        if os.environ.get("GRCTL_DEBUG") == "1":
            err_console.print_exception()
        err_console.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(1)


from grctl.cli_client import register  # noqa: E402, I001  (push, pause, flush, status, ...)

register(app)
