"""The grctl command line: each command is a thin signature over a plain function."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console

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


def main() -> None:
    """Entry point: run the app, print a GrctlError as one red line (traceback with GRCTL_DEBUG=1)."""
    try:
        app(standalone_mode=True)
    except GrctlError as exc:
        if os.environ.get("GRCTL_DEBUG") == "1":
            err_console.print_exception()
        err_console.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(1)
