"""The root `grctl` app: --version, every command group registered here, and main(), which maps
what a command raises to the documented exit code."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from rich.markup import escape
from typer import rich_utils

import grctl
from grctl.cli import catalog, control, demo, generate, serve, sync
from grctl.cli.output import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    console,
    err_console,
    print_json,
    usage_error_doc,
)
from grctl.errors import GrctlError

app = typer.Typer(
    name="grctl",
    help="Serve Qwen3 generative-recommendation models and hot-swap their weights.\n\n"
    "Exit codes: 0 ok, 1 failed, 2 usage error, 130 interrupted. The client commands take"
    " --json (one JSON document on stdout); see docs/cli.md.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion [bash|zsh|fish|powershell]
)
# The order here is the order of `grctl --help` (groups after commands).
for command in (
    generate.generate,
    serve.serve,
    sync.push,
    control.pause,
    control.resume,
    control.flush,
    control.status,
    sync.verify,
    demo.demo,
):
    app.command(command.__name__)(command)
app.add_typer(generate.model_app, name="model")
app.add_typer(catalog.catalog_app, name="catalog")

# Typer 0.2x vendors Click, older versions use click itself: take the base of the usage errors
# from the class Typer exports either way.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def show_version(value: bool) -> None:
    if value:
        console.print(f"grctl {grctl.__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            callback=show_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """The options of grctl itself (the app's help is set on the Typer above)."""


def main() -> None:
    """Run the app and exit with the documented code (grctl/cli/output.py): 0 ok, 1 failed,
    2 usage, 130 interrupted. A GrctlError prints one red line (a traceback with
    GRCTL_DEBUG=1); with --json a usage error is also a JSON document on stdout."""
    try:
        code = app(prog_name="grctl", standalone_mode=False)  # also under python -m grctl
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
