"""Client commands: push, pause, resume, flush, status, verify, demo.

Each command is a thin Typer signature over a plain `run_*` function. Failures raise GrctlError:
`grctl.cli.main` prints it as one red line (traceback with GRCTL_DEBUG=1) and exits 1; usage
errors exit 2 (Typer). Every command takes --url (repeatable, env GR_URL) and --api-key (env
GR_HTTP_API_KEY). Registered onto the app by `register(app)` at the end of grctl/cli.py.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from grctl.client import report
from grctl.client.http import DEFAULT_URL, GRClient
from grctl.errors import GrctlError

console = Console()
err_console = Console(stderr=True)

Urls = Annotated[
    Optional[list[str]],
    typer.Option(
        "--url",
        envvar="GR_URL",
        show_default=DEFAULT_URL,
        help="Server URL; repeat it for a fleet (GR_URL: space-separated URLs).",
    ),
]
ApiKey = Annotated[
    Optional[str],
    typer.Option(envvar="GR_HTTP_API_KEY", show_default=False, help="The servers' API key."),
]
Timeout = Annotated[float, typer.Option(min=0.1, help="Seconds to wait for each reply.")]


class Transport(str, Enum):
    tensor = "tensor"
    disk = "disk"


TRANSPORT_HELP = (
    "tensor: this process stages buckets on the server's device (shared memory or CUDA IPC); "
    "disk: the servers read the checkpoint path themselves."
)


class PauseMode(str, Enum):
    abort = "abort"
    retract = "retract"
    in_place = "in_place"


def each_server(
    urls: list[str] | None, api_key: str | None, timeout: float, fn: Callable[[GRClient], Any]
) -> list[tuple[str, Any]]:
    """Call `fn` on every server; an error is kept as its text, and raised once all have run."""
    rows, failed = [], []
    for url in urls or [DEFAULT_URL]:
        try:
            with GRClient(url, api_key=api_key, timeout=timeout) as gr:
                rows.append((url, fn(gr)))
        except GrctlError as exc:
            rows.append((url, f"[red]{exc}[/red]"))
            failed.append(f"{url}: {exc}")
    return rows if not failed else _raise(rows, failed)


def _raise(rows: list, failed: list[str]):
    console.print(report.replies_table("replies", rows))
    raise GrctlError(f"{len(failed)} of {len(rows)} server(s) failed: " + "; ".join(failed))


def run_pause(urls, mode: str, api_key=None, timeout: float = 30.0) -> list:
    rows = each_server(urls, api_key, timeout, lambda gr: gr.pause_generation(mode))
    console.print(report.replies_table(f"pause_generation (mode={mode})", rows))
    return rows


def run_resume(urls, api_key=None, timeout: float = 30.0) -> list:
    rows = each_server(urls, api_key, timeout, lambda gr: gr.continue_generation())
    console.print(report.replies_table("continue_generation", rows))
    return rows


def run_flush(urls, retries: int, interval: float, api_key=None, timeout: float = 30.0) -> list:
    rows = each_server(
        urls, api_key, timeout, lambda gr: gr.flush_cache_until_ok(retries, interval)
    )
    console.print(report.replies_table("flush_cache", rows))
    return rows


def run_status(urls, api_key=None, timeout: float = 30.0) -> list:
    rows = each_server(urls, api_key, timeout, lambda gr: gr.status())
    for url, status in rows:
        console.print(report.status_table(url, status))
    return rows


def run_verify(urls, checkpoint: Path, api_key=None, timeout: float = 120.0) -> dict[str, list]:
    """Every served tensor's sha256 against the checkpoint cast to the served dtype."""
    from grctl.client.verify import CheckpointDigests, mismatches

    rows = each_server(urls, api_key, timeout, lambda gr: gr.weights_checker("checksum"))
    bad: dict[str, list[str]] = {}
    with_digests = CheckpointDigests(checkpoint)
    try:
        for url, check in rows:
            found = mismatches(check, with_digests)
            if found:
                bad[url] = found
                for line in found:
                    console.print(f"[red]MISMATCH[/red] {url} {line}", highlight=False)
            else:
                n, v = len(check.tensors), check.weight_version
                console.print(f"[green]OK[/green] {url}: {n} tensors match (version {v})")
    finally:
        with_digests.close()
    if bad:
        named = "; ".join(
            f"{url}: {len(lines)} tensor(s) differ ({shorten(lines)})" for url, lines in bad.items()
        )
        raise GrctlError(f"verification failed on {len(bad)} server(s): {named}")
    return bad


def shorten(lines: list[str], shown: int = 4) -> str:
    names = [line.split(":")[0] for line in lines]
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def run_push(urls, checkpoint: Path, *, verify: bool, api_key=None, **sync_kw: Any):
    """WeightSync with a progress bar, then the summary table (also when it fails)."""
    from grctl.client.outcome import SyncError
    from grctl.client.sync import WeightSync

    version, token_step = sync_kw.pop("weight_version", None), sync_kw.pop("token_step", None)
    transport = sync_kw.get("transport", "tensor")
    with report.push_progress(err_console, transport) as on_progress:
        with WeightSync(
            urls,  # None: DEFAULT_URL, unless a router names the servers
            api_key=api_key,
            verify=verify,
            on_progress=on_progress,
            **sync_kw,
        ) as sync:
            try:
                result = sync.run(checkpoint, weight_version=version, token_step=token_step)
            except SyncError as exc:
                console.print(report.sync_table(exc.result))
                raise
    console.print(report.sync_table(result))
    return result


def push(
    checkpoint: Annotated[Path, typer.Option(help="HF checkpoint directory to push.")],
    url: Urls = None,
    router: Annotated[
        Optional[str],
        typer.Option(envvar="GR_ROUTER", help="sglang-router URL: push to every worker it lists."),
    ] = None,
    transport: Annotated[Transport, typer.Option(help=TRANSPORT_HELP)] = Transport.tensor,
    chunked: Annotated[bool, typer.Option(help="Several buckets (else one).")] = True,
    bucket_mb: Annotated[float, typer.Option(min=0.0001, help="Bucket size, MiB.")] = 512,
    weight_version: Annotated[Optional[str], typer.Option(help="Version label to set.")] = None,
    token_step: Annotated[Optional[int], typer.Option(help="Training step label.")] = None,
    pause_mode: Annotated[PauseMode, typer.Option(help="How to pause.")] = PauseMode.abort,
    verify: Annotated[bool, typer.Option(help="Compare every tensor's sha256 after.")] = True,
    flush_retries: Annotated[int, typer.Option(min=1, help="flush_cache tries.")] = 60,
    flush_interval: Annotated[float, typer.Option(min=0, help="Seconds between tries.")] = 1.0,
    api_key: ApiKey = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds per update call.")] = 600.0,
) -> None:
    """Pause, flush, push a checkpoint, resume and verify, on one server or a fleet."""
    run_push(
        url,
        checkpoint,
        verify=verify,
        api_key=api_key,
        transport=transport.value,
        chunked=chunked,
        bucket_mb=bucket_mb,
        weight_version=weight_version,
        token_step=token_step,
        pause_mode=pause_mode.value,
        flush_retries=flush_retries,
        flush_interval=flush_interval,
        update_timeout=timeout,
        router=router,
    )


def pause(
    url: Urls = None,
    mode: PauseMode = PauseMode.abort,
    api_key: ApiKey = None,
    timeout: Timeout = 30,
) -> None:
    """Pause generation (abort, retract or in_place)."""
    run_pause(url, mode.value, api_key, timeout)


def resume(url: Urls = None, api_key: ApiKey = None, timeout: Timeout = 30) -> None:
    """Resume generation (continue_generation)."""
    run_resume(url, api_key, timeout)


def flush(
    url: Urls = None,
    retries: Annotated[int, typer.Option(min=1, help="Tries before giving up.")] = 60,
    interval: Annotated[float, typer.Option(min=0, help="Seconds between tries.")] = 1.0,
    api_key: ApiKey = None,
    timeout: Timeout = 30,
) -> None:
    """Flush the prefill cache, retrying while requests still hold KV (slime's loop)."""
    run_flush(url, retries, interval, api_key, timeout)


def status(url: Urls = None, api_key: ApiKey = None, timeout: Timeout = 30) -> None:
    """Show /status: scheduler, requests, prefill cache, engine and weights."""
    run_status(url, api_key, timeout)


def verify(
    checkpoint: Annotated[Path, typer.Option(help="HF checkpoint directory to compare with.")],
    url: Urls = None,
    api_key: ApiKey = None,
    timeout: Timeout = 120,
) -> None:
    """Compare every served tensor's sha256 with the checkpoint's (exit 1 on a mismatch)."""
    run_verify(url, checkpoint, api_key, timeout)


def demo(
    device: Annotated[str, typer.Option(help="Device of the demo server.")] = "cpu",
) -> None:
    """Start a server, generate, push perturbed weights (tensor), restore them (disk), verify."""
    from grctl.demo import run_demo

    run_demo(console, device=device)


def register(app: typer.Typer) -> None:
    for fn in (push, pause, resume, flush, status, verify, demo):
        app.command(fn.__name__)(fn)
