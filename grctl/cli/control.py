"""`grctl pause | resume | flush | status`: one call on each server, its reply shown in a table."""

from __future__ import annotations

from typing import Annotated

import typer

from grctl.cli import report
from grctl.cli.options import ApiKey, Json, PauseMode, Timeout, Urls
from grctl.cli.output import command_output, console
from grctl.cli.servers import Row, each_server, finish, replies


def run_pause(urls, mode: str, api_key=None, timeout: float = 30.0, as_json=False) -> None:
    with command_output("pause", as_json) as out:
        rows = each_server(urls, api_key, timeout, lambda gr: gr.pause_generation(mode))
        finish(out, rows, replies(f"pause_generation (mode={mode})"))


def run_resume(urls, api_key=None, timeout: float = 30.0, as_json=False) -> None:
    with command_output("resume", as_json) as out:
        rows = each_server(urls, api_key, timeout, lambda gr: gr.continue_generation())
        finish(out, rows, replies("continue_generation"))


def run_flush(
    urls, retries: int, interval: float, api_key=None, timeout: float = 30.0, as_json=False
) -> None:
    with command_output("flush", as_json) as out:
        rows = each_server(
            urls, api_key, timeout, lambda gr: gr.flush_cache_until_ok(retries, interval)
        )
        finish(out, rows, replies("flush_cache"))


def run_status(urls, api_key=None, timeout: float = 30.0, as_json=False) -> None:
    def show(rows: list[Row]) -> None:
        for url, status in rows:
            console.print(report.status_view(url, status))

    with command_output("status", as_json) as out:
        rows = each_server(urls, api_key, timeout, lambda gr: gr.status())
        finish(out, rows, show, as_doc=lambda st: {**st.sections, "weights": st.weights})


def pause(
    url: Urls = None,
    mode: PauseMode = PauseMode.abort,
    api_key: ApiKey = None,
    timeout: Timeout = 30,
    json: Json = False,
) -> None:
    """Pause generation (abort, retract or in_place)."""
    run_pause(url, mode.value, api_key, timeout, json)


def resume(
    url: Urls = None, api_key: ApiKey = None, timeout: Timeout = 30, json: Json = False
) -> None:
    """Resume generation (continue_generation)."""
    run_resume(url, api_key, timeout, json)


def flush(
    url: Urls = None,
    retries: Annotated[int, typer.Option(min=1, help="Tries before giving up.")] = 60,
    interval: Annotated[float, typer.Option(min=0, help="Seconds between tries.")] = 1.0,
    api_key: ApiKey = None,
    timeout: Timeout = 30,
    json: Json = False,
) -> None:
    """Flush the prefill cache, retrying while requests still hold KV (slime's loop)."""
    run_flush(url, retries, interval, api_key, timeout, json)


def status(
    url: Urls = None, api_key: ApiKey = None, timeout: Timeout = 30, json: Json = False
) -> None:
    """Show each server's state in a few lines (--json: all of /status)."""
    run_status(url, api_key, timeout, json)
