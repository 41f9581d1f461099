"""What the commands print: Rich for people (the two consoles), or one JSON document for scripts
(--json), and the exit codes.

    def status(url: Urls = None, json: Json = False) -> None:
        with command_output("status", json) as out:
            rows = ...
            out.emit({"ok": True, "servers": [...]}, human=lambda: console.print(table))

With --json, stdout holds exactly one JSON document, also when the command fails: a failure
inside the command emits `{"command", "ok": false, "error": {code, message, retryable, status}}`
unless the command already emitted its own (per-server) document. The exit code is the same
with or without --json (EXIT_* below, documented in docs/cli.md); main() in grctl/cli/root.py maps
exceptions to them.
"""

from __future__ import annotations

import json as jsonlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from rich.console import Console

from grctl.errors import GrctlError

console = Console()
err_console = Console(stderr=True)  # progress, hints and the red error line

EXIT_OK = 0
EXIT_FAILED = 1  # a server answered an error, could not be reached, or a sync/verify failed
EXIT_USAGE = 2  # a bad flag or value: nothing was sent
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGINT (128 + 2, as shells report it)


def to_builtins(obj: Any) -> Any:
    """msgspec Structs, dataclasses and enums as plain JSON values; anything else as its str."""
    return msgspec.to_builtins(obj, enc_hook=str)


def error_doc(exc: BaseException) -> dict[str, Any]:
    """The contract's error shape for any failure, also one that never reached a server."""
    if isinstance(exc, GrctlError):
        return exc.to_dict()
    if isinstance(exc, KeyboardInterrupt):
        return {"code": "interrupted", "message": "interrupted", "retryable": True, "status": 0}
    return {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}",
            "retryable": False, "status": 0}  # fmt: skip


def print_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(jsonlib.dumps(to_builtins(doc), indent=2) + "\n")
    sys.stdout.flush()


@dataclass
class Output:
    command: str
    is_json: bool
    emitted: bool = False

    def emit(self, doc: dict[str, Any], human: Callable[[], None] | None = None) -> None:
        """The command's result: `doc` as JSON with --json, else whatever `human` prints."""
        if self.is_json:
            print_json({"command": self.command, **doc})
        elif human is not None:
            human()
        self.emitted = True


@contextmanager
def command_output(command: str, is_json: bool) -> Iterator[Output]:
    """An Output for one command run; a failure with nothing emitted yet becomes the JSON error
    document (with --json), then goes on to main() for its red line and exit code."""
    out = Output(command, is_json)
    try:
        yield out
    except (GrctlError, KeyboardInterrupt) as exc:
        if is_json and not out.emitted:
            out.emit({"ok": False, "error": error_doc(exc)})
        raise


def usage_error_doc(exc: Any) -> dict[str, Any]:
    """A usage error (exit 2, a Click exception) as a JSON document, for `--json` runs."""
    names, ctx = [], getattr(exc, "ctx", None)
    while ctx is not None and ctx.parent is not None:  # the root's name is the program's
        names.append(ctx.info_name)
        ctx = ctx.parent
    doc = {"ok": False, "error": {"code": "usage_error", "message": exc.format_message(),
                                  "retryable": False, "status": 0}}  # fmt: skip
    return {"command": " ".join(reversed(names)), **doc} if names else doc
