"""Calling each server in turn for a client command, then printing the replies (a table, or
the --json document of output.py) and raising once for the servers that failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grctl.cli import report
from grctl.cli.output import Output, console, to_builtins
from grctl.client import outcome
from grctl.client.http import DEFAULT_URL, GRClient
from grctl.errors import GrctlError

Row = tuple[str, Any]  # (url, the reply, or the GrctlError it raised)


def each_server(
    urls: list[str] | None, api_key: str | None, timeout: float, fn: Callable[[GRClient], Any]
) -> list[Row]:
    """Call `fn` on every server; an error is kept in its row (see `finish`)."""
    rows: list[Row] = []
    for url in urls or [DEFAULT_URL]:
        try:
            with GRClient(url, api_key=api_key, timeout=timeout) as gr:
                rows.append((url, fn(gr)))
        except GrctlError as exc:
            rows.append((url, exc))
    return rows


def server_doc(url: str, reply: Any) -> dict[str, Any]:
    if isinstance(reply, GrctlError):
        return {"url": url, "ok": False, "error": reply.to_dict()}
    return {"url": url, "ok": True, "reply": reply}


def finish(
    out: Output,
    rows: list[Row],
    human: Callable[[list[Row]], None],
    as_doc: Callable[[Any], Any] = to_builtins,
) -> None:
    """Emit the rows (human: the servers that answered; JSON: all, each reply through
    `as_doc`), then raise once for the servers that failed, each named with its error."""
    failed = [(url, exc) for url, exc in rows if isinstance(exc, GrctlError)]
    docs = [server_doc(url, r if isinstance(r, GrctlError) else as_doc(r)) for url, r in rows]
    doc = {"ok": not failed, "servers": docs}
    out.emit(doc, human=lambda: human([r for r in rows if not isinstance(r[1], GrctlError)]))
    if failed:
        named = "; ".join(f"{url}: {outcome.describe(exc)}" for url, exc in failed)
        raise GrctlError(f"{len(failed)} of {len(rows)} server(s) failed: {named}")


def replies(title: str) -> Callable[[list[Row]], None]:
    return lambda rows: rows and console.print(report.replies_table(title, rows))
