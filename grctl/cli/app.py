"""The grctl command line: each command is a thin signature over a plain function."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer import rich_utils

import grctl
from grctl.cli.output import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, print_json, usage_error_doc
from grctl.errors import GrctlError

app = typer.Typer(
    name="grctl",
    help="Serve Qwen3 generative-recommendation models and hot-swap their weights.\n\n"
    "Exit codes: 0 ok, 1 failed, 2 usage error, 130 interrupted. The client commands take"
    " --json (one JSON document on stdout); see docs/cli.md.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="The built-in default model.", no_args_is_help=True)
app.add_typer(model_app, name="model")

err_console = Console(stderr=True)
# Typer 0.2x vendors Click, older versions use click itself: take the base of the usage errors
# from the class Typer exports either way.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
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
    from grctl.cli.generate import generate_offline

    try:
        ids = [int(t) for t in input_ids.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise typer.BadParameter("input ids must be integers separated by commas") from exc
    for line in generate_offline(model_path, ids, max_new_tokens, n, device):
        typer.echo(line)  # tab-separated as made: rich would expand the tabs


def show_version(value: bool) -> None:
    if value:
        console.print(f"grctl {grctl.__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """The options of grctl itself (the app's help is set on the Typer above)."""


def main() -> None:
    """Run the app and exit with the documented code (grctl/cli/output.py): 0 ok, 1 failed,
    2 usage, 130 interrupted. A GrctlError prints one red line (a traceback with
    GRCTL_DEBUG=1); with --json a usage error is also a JSON document on stdout."""
    try:
        code = app(standalone_mode=False)
    except ClickException as exc:  # usage errors: bad flag, bad value, missing option
        if "--json" in sys.argv[1:]:
            print_json(usage_error_doc(exc))
        rich_utils.rich_format_error(exc)
        sys.exit(exc.exit_code)
    except typer.Abort:  # EOF on a prompt
        sys.exit(EXIT_INTERRUPTED)
    except GrctlError as exc:
        if os.environ.get("GRCTL_DEBUG") == "1":
            err_console.print_exception()
        err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        sys.exit(EXIT_FAILED)
    if code == EXIT_INTERRUPTED:  # Typer turns Ctrl-C into Exit(130)
        err_console.print("[red]interrupted[/red]")
    sys.exit(code if isinstance(code, int) else EXIT_OK)


from grctl.cli import catalog as cli_catalog  # noqa: E402, I001  (other modules' commands)


from grctl.cli import sync as cli_sync  # noqa: E402, I001  (other modules' commands)


from grctl.cli import serve as cli_serve  # noqa: E402, I001  (other modules' commands)

cli_serve.register(app)
cli_sync.register(app)
cli_catalog.register(app)
