"""The `grctl` command line (Typer): one module per command group.

main() sets the process's threading defaults (grctl/threads.py) before anything imports torch,
so this module imports the app (and torch with it) only when asked for it.
"""

from __future__ import annotations

from typing import Any

from grctl.threads import apply_defaults

__all__ = ["app", "main"]


def main() -> None:
    """The `grctl` entry point: the threading defaults first, then the app."""
    apply_defaults()
    from grctl.cli.root import main as run

    run()


def __getattr__(name: str) -> Any:
    if name == "app":
        from grctl.cli.root import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
