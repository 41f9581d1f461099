"""The options the client commands share: --url, --api-key, --timeout, --verbose, --json, and
the pause modes (pause, push --pause-mode)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from grctl.client.http import DEFAULT_URL, normalize_url
from grctl.engine.gate import PAUSE_MODES
from grctl.errors import GrctlError


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
Json = Annotated[
    bool,
    typer.Option(
        "--json", help="Print one JSON document on stdout (for scripts); same exit codes."
    ),
]


PauseMode = Enum("PauseMode", {m: m for m in PAUSE_MODES}, type=str, module=__name__)
