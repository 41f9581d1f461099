"""`grctl push | verify`: a WeightSync with its progress bar and summary, and the sha256
comparison of every served tensor with a checkpoint's.

Failures raise GrctlError (main() in app.py prints one red line, exit 1); a push stopped by
Ctrl-C, SIGTERM, SIGHUP or SIGQUIT exits 128 + the signal's number (130 / 143 / 129 / 131)
after naming what it left on each server.
"""

from __future__ import annotations

import shlex
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from grctl.cli import report
from grctl.cli.options import ApiKey, Json, PauseMode, Timeout, Urls, Verbose
from grctl.cli.output import command_output, console, err_console, to_builtins
from grctl.cli.servers import each_server, server_doc
from grctl.client import outcome
from grctl.client.outcome import TRANSPORTS
from grctl.errors import GrctlError

Transport = Enum("Transport", {t: t for t in ("auto", *TRANSPORTS)}, type=str, module=__name__)
TRANSPORT_HELP = (
    "auto: servers on this host read the checkpoint, others get staged buckets; "
    "tensor: always stage; disk: always send the path."
)


def run_verify(urls, checkpoint: Path, api_key=None, timeout: float = 120.0, as_json=False):
    """Every served tensor's sha256 against the checkpoint cast to the served dtype."""
    from grctl.client.verify import CheckpointDigests, mismatches

    with command_output("verify", as_json) as out:
        rows = each_server(urls, api_key, timeout, lambda gr: gr.weights_checker("checksum"))
        docs, bad = [], {}
        with_digests = CheckpointDigests(checkpoint)
        try:
            for url, check in rows:
                if isinstance(check, GrctlError):
                    docs.append(server_doc(url, check))
                    continue
                found = mismatches(check, with_digests)
                if found:
                    bad[url] = found
                docs.append({"url": url, "ok": not found, "weight_version": check.weight_version,
                             "num_tensors": len(check.tensors), "mismatches": found})  # fmt: skip
        finally:
            with_digests.close()

        def show() -> None:
            for doc in docs:
                url = doc["url"]
                for line in doc.get("mismatches", []):
                    console.print(f"[red]MISMATCH[/red] {url} {escape(str(line))}", highlight=False)
                if doc["ok"]:
                    n, v = doc["num_tensors"], doc["weight_version"]
                    console.print(
                        f"[green]OK[/green] {url}: {n} tensors match (version {escape(str(v))})"
                    )

        out.emit({"ok": all(d["ok"] for d in docs), "servers": docs}, human=show)
        unreachable = [(url, r) for url, r in rows if isinstance(r, GrctlError)]
        problems = [f"{url}: {len(lines)} tensor(s) differ ({shorten(lines)})"
                    for url, lines in bad.items()]  # fmt: skip
        problems += [f"{url}: {outcome.describe(exc)}" for url, exc in unreachable]
        if problems:
            num = len(bad) + len(unreachable)
            raise GrctlError(f"verification failed on {num} server(s): " + "; ".join(problems))


def shorten(lines: list[str], shown: int = 4) -> str:
    names = [line.split(":")[0] for line in lines]
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def run_push(
    urls, checkpoint: Path, *, verify: bool, api_key=None, as_json=False, verbose=False, **sync_kw
):
    """WeightSync with a progress bar, then the summary (also when it fails). Ctrl-C or
    SIGTERM, SIGHUP or SIGQUIT: each server's state and the command that finishes the job;
    exit 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM)."""
    from grctl.client.outcome import SyncError, SyncInterrupted, Terminated, exit_code
    from grctl.client.sync import WeightSync

    version, token_step = sync_kw.pop("weight_version", None), sync_kw.pop("token_step", None)
    catalog = sync_kw.pop("catalog_path", None)
    sync_type = delta_sync(sync_kw) or WeightSync  # --delta: grctl/client/delta_push.py
    transport = sync_kw.get("transport", "auto")
    finish = finish_command(checkpoint, transport, sync_kw, version, token_step, api_key, catalog)

    def show(result) -> None:
        (report.sync_details if verbose else report.sync_lines)(console, result)
        partial = [o.url for o in result.servers if o.is_partial]
        if partial:
            err_console.print(report.finish_hint(partial, finish), highlight=False, soft_wrap=True)

    try:
        with command_output("push", as_json) as out:
            with (
                on_stop_signals(Terminated),
                report.push_progress(err_console, transport) as on_progress,
                sync_type(
                    urls,  # None: DEFAULT_URL, unless a router names the servers
                    api_key=api_key,
                    verify=verify,
                    on_progress=on_progress,
                    **sync_kw,
                ) as sync,
            ):
                try:
                    result = sync.run(
                        checkpoint,
                        weight_version=version,
                        token_step=token_step,
                        catalog_path=catalog,
                    )
                except SyncError as exc:
                    failed = exc.result
                    doc = {"ok": False, "error": exc.to_dict(), "result": sync_doc(failed, finish)}
                    out.emit(doc, human=lambda: show(failed))
                    raise
                except SyncInterrupted as exc:
                    stopped = exc.result

                    def tell() -> None:
                        text = report.interrupted_report(stopped, finish)
                        err_console.print(text, highlight=False, soft_wrap=True)

                    error = {"code": "interrupted", "message": str(exc), "retryable": True}
                    doc = {"ok": False, "error": error, "result": sync_doc(stopped, finish)}
                    out.emit(doc, human=tell)
                    raise typer.Exit(exit_code(stopped.interrupted_by)) from None
            out.emit({"ok": True, "result": sync_doc(result, finish)}, human=lambda: show(result))
    except KeyboardInterrupt as exc:  # before WeightSync started: nothing was paused
        raise typer.Exit(128 + getattr(exc, "signum", signal.SIGINT)) from None
    return result


def delta_sync(sync_kw: dict):
    """--delta BASE: a DeltaSync from BASE (the transport options dropped: the servers read
    the delta), else None. A server left torn is finished by a whole push (transport auto)."""
    base, delta_dir = sync_kw.pop("delta", None), sync_kw.pop("delta_dir", None)
    if base is None:
        return None
    from functools import partial

    from grctl.client.delta_push import DeltaSync

    for key in ("transport", "chunked", "bucket_mb"):
        sync_kw.pop(key, None)
    return partial(DeltaSync, base=base, delta_dir=delta_dir)


def sync_doc(result, finish) -> dict[str, Any]:
    servers = [
        {
            **to_builtins(s),
            "ok": s.ok,
            "state": s.left_as() if not s.ok else "ok",
            "partial": s.is_partial,
            **({"finish_command": finish(s.url)} if s.is_partial else {}),
        }
        for s in result.servers
    ]
    return {**to_builtins(result), "servers": servers, "push_gbps": result.push_gbps}


def finish_command(checkpoint, transport, sync_kw, version, token_step, api_key, catalog=None):
    """`url -> the grctl push that finishes the job on that server` (the whole push, again)."""
    args = ["grctl", "push", "--checkpoint", str(Path(checkpoint).resolve())]
    args += ["--transport", transport]
    if transport != "disk":
        args += ["--bucket-mb", f"{sync_kw.get('bucket_mb') or 512:g}"]
    if version is not None:
        args += ["--weight-version", str(version)]
    if token_step is not None:
        args += ["--token-step", str(token_step)]
    if catalog is not None:
        args += ["--catalog", str(Path(catalog).resolve())]
    tail = ' --api-key "$GR_API_KEY"' if api_key else ""
    return lambda url: shlex.join([*args, "--url", url]) + tail


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@contextmanager
def on_stop_signals(exc_type: type[BaseException]) -> Iterator[None]:
    """In the main thread, Ctrl-C raises KeyboardInterrupt and SIGTERM, SIGHUP (a closed
    terminal, whose default action killed the push mid-pause and left the server paused) and
    SIGQUIT raise `exc_type(signum)`, so a push stops through one path whatever stopped it.
    Only the first signal raises: the ones after it, while the push winds down (waits for the
    bucket in flight, resumes what it may, prints what it left and the command that finishes
    the job), are ignored, so a second Ctrl-C cannot cut the report short; after a stop they
    stay ignored while the process exits (torch's exit hooks, interrupted, print a traceback
    under the report). Without a stop the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping: list[int] = []

    def handler(signum, frame):
        if stopping:
            return
        stopping.append(signum)
        raise KeyboardInterrupt() if signum == signal.SIGINT else exc_type(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, signal.SIG_IGN if stopping else handler_before)


def push(
    checkpoint: Annotated[
        Path, typer.Option(metavar="DIR", help="HF checkpoint directory to push.")
    ],
    url: Urls = None,
    router: Annotated[
        Optional[str],
        typer.Option(envvar="GR_ROUTER", help="sglang-router URL: push to every worker it lists."),
    ] = None,
    transport: Annotated[Transport, typer.Option(help=TRANSPORT_HELP)] = Transport.auto,
    chunked: Annotated[
        Optional[bool],
        typer.Option(help="Several buckets, else one (staged; default: chunked)."),
    ] = None,
    bucket_mb: Annotated[
        Optional[float],
        typer.Option(min=0.0001, metavar="MB", help="Bucket MiB (staged; default: 512)."),
    ] = None,
    weight_version: Annotated[Optional[str], typer.Option(help="Version label to set.")] = None,
    token_step: Annotated[Optional[int], typer.Option(help="Training step label.")] = None,
    catalog: Annotated[
        Optional[Path],
        typer.Option(
            metavar="PATH",
            help="Item catalog JSONL of these weights, installed with them (the server reads "
            "it; needs --allow-catalog-reload there).",
        ),
    ] = None,
    delta: Annotated[
        Optional[Path],
        typer.Option(
            metavar="BASE",
            help="Send only what changed since BASE, the checkpoint the servers serve: a delta "
            "is made here before the pause, each server applies it in place (/pull_weights).",
        ),
    ] = None,
    delta_dir: Annotated[
        Optional[Path],
        typer.Option(
            metavar="DIR",
            help="Where --delta writes its version, a directory the servers read (kept; "
            "default: a temporary one beside --checkpoint, removed after).",
        ),
    ] = None,
    pause_mode: Annotated[PauseMode, typer.Option(help="How to pause.")] = PauseMode.abort,
    verify: Annotated[bool, typer.Option(help="Compare every tensor's sha256 after.")] = True,
    flush_retries: Annotated[int, typer.Option(min=1, help="flush_cache tries.")] = 60,
    flush_interval: Annotated[float, typer.Option(min=0, help="Seconds between tries.")] = 1.0,
    api_key: ApiKey = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds per update call.")] = 600.0,
    json: Json = False,
    verbose: Verbose = False,
) -> None:
    """Pause, flush, push a checkpoint, resume and verify, on one server or a fleet."""
    if transport is Transport.disk and (chunked is not None or bucket_mb is not None):
        flag = "--chunked/--no-chunked" if chunked is not None else "--bucket-mb"
        raise typer.BadParameter(
            f"{flag} applies to --transport tensor only: with disk the servers read the "
            "checkpoint files themselves",
            param_hint="'--transport disk'",
        )
    if delta is None and delta_dir is not None:
        raise typer.BadParameter("--delta-dir goes with --delta BASE", param_hint="'--delta-dir'")
    if delta is not None and (
        transport is not Transport.auto or chunked is not None or bucket_mb is not None
    ):
        raise typer.BadParameter(
            "--transport, --chunked and --bucket-mb do not apply to --delta: the servers read "
            "the delta's files",
            param_hint="'--delta'",
        )
    run_push(
        url,
        checkpoint,
        verify=verify,
        api_key=api_key,
        as_json=json,
        verbose=verbose,
        transport=transport.value,
        chunked=chunked,  # None: the default; either given asks auto for staged buckets
        bucket_mb=bucket_mb,
        weight_version=weight_version,
        token_step=token_step,
        catalog_path=catalog,
        pause_mode=pause_mode.value,
        flush_retries=flush_retries,
        flush_interval=flush_interval,
        update_timeout=timeout,
        router=router,
        **({"delta": delta, "delta_dir": delta_dir} if delta is not None else {}),
    )


def verify(
    checkpoint: Annotated[Path, typer.Option(help="HF checkpoint directory to compare with.")],
    url: Urls = None,
    api_key: ApiKey = None,
    timeout: Timeout = 120,
    json: Json = False,
) -> None:
    """Compare every served tensor's sha256 with the checkpoint's (exit 1 on a mismatch)."""
    run_verify(url, checkpoint, api_key, timeout, json)
