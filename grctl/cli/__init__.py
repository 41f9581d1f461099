"""The `grctl` command line (Typer): one module per command group."""

from grctl.cli.app import app, main

__all__ = ["app", "main"]
