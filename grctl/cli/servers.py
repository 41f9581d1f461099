"""What every client command shares: --url, --api-key, --timeout, --verbose, and calling each
server in turn, then printing the replies (a table, or the --json document of cli_output.py)
and raising once for the servers that failed. Used by cli_client.py and cli_catalog.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from grctl.cli import report
from grctl.cli.output import Output, to_builtins
from grctl.client import outcome
from grctl.client.http import DEFAULT_URL, GRClient, normalize_url
from grctl.errors import GrctlError

console = Console()
err_console = Console(stderr=True)


def normalize_urls(urls: list[str] | None) -> list[str] | None:
    try:
        return None if urls is None else [normalize_url(u) for u in urls]
    except GrctlError as exc:
        raise typer.BadParameter(str(exc)) from None


Urls = Annotated[
    Optional[list[str]],
    typer.Option(
        "--url",
        callback=normalize_urls,
        envvar="GR_URL",
        metavar="URL",
        show_default=False,
        help=f"Server URL (default {DEFAULT_URL}); repeat for a fleet. GR_URL: space-separated.",
    ),
]
ApiKey = Annotated[
    Optional[str],
    typer.Option(
        envvar=["GR_API_KEY", "GR_HTTP_API_KEY"],
        show_default=False,
        metavar="KEY",
        help="The servers' API key (GR_API_KEY; GR_HTTP_API_KEY still read).",
    ),
]
Timeout = Annotated[
    float, typer.Option(min=0.1, metavar="SECONDS", help="Seconds to wait for each reply.")
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Every detail, per server.")]


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
