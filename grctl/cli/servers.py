"""Calling every server of a client command at once, then printing the replies (a table, or
the --json document of output.py) and raising once for the servers that failed."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grctl.cli import report
from grctl.cli.output import Output, console, to_builtins
from grctl.client import outcome
from grctl.client.http import DEFAULT_URL, GRClient
from grctl.errors import GrctlError

MAX_THREADS = 64  # servers called at once; a larger fleet is called in waves of this many
Row = tuple[str, Any]  # (url, the reply, or the GrctlError it raised)


def each_server(
    urls: list[str] | None, api_key: str | None, timeout: float, fn: Callable[[GRClient], Any]
) -> list[Row]:
    """Call `fn` on every server at once (a thread each, as a push does), so a fleet's command
    takes as long as its slowest server, not the sum; the rows keep the order of `urls`, and an
    error is kept in its row (see `finish`)."""

    def one(url: str) -> Row:
        try:
            with GRClient(url, api_key=api_key, timeout=timeout) as gr:
                return url, fn(gr)
        except GrctlError as exc:
            return url, exc

    targets = list(urls or [DEFAULT_URL])
    if len(targets) == 1:
        return [one(targets[0])]
    pool = ThreadPoolExecutor(min(len(targets), MAX_THREADS), thread_name_prefix="grctl-fleet")
    try:
        return list(pool.map(one, targets))
    finally:  # Ctrl-C: do not wait out the calls still running
        pool.shutdown(wait=False, cancel_futures=True)


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
