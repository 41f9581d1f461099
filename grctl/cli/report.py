"""Rich output for the client commands: the push progress bar, the summaries and the tables."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from grctl.client import outcome
from grctl.protocol.info import ServerStatus


@contextmanager
def push_progress(console: Console, transport: str) -> Iterator[Any]:
    """Yields an on_progress callback for WeightSync: bytes, buckets and GB/s as buckets land."""
    columns = [
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TextColumn("{task.fields[buckets]}"),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=True) as bar:
        label = "loading from disk (server side)" if transport == "disk" else "pushing"
        task = bar.add_task(label, total=None, buckets="")

        def on_progress(p: outcome.Progress) -> None:
            bar.update(
                task,
                completed=p.bytes_done,
                total=p.bytes_total,
                buckets=f"{p.buckets_done}/{p.buckets_total} buckets",
            )

        yield on_progress


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def fmt_rate(bytes_per_s: float) -> str:
    """GB/s as the benchmarks report it, MB/s below 1 GB/s (no `0.00 GB/s` for small pushes)."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def sync_lines(console: Console, result: outcome.SyncResult) -> None:
    """The push summary that fits 80 columns: a headline, what moved, one row per server."""
    num_ok = sum(s.ok for s in result.servers)
    target = result.weight_version or "(label unchanged)"
    total = result.timings.get("total", 0.0)
    console.print(
        f"push {result.transport} -> version {target}: {num_ok} of {len(result.servers)} "
        f"server(s) ok in {total:.2f} s; {moved(result)}",
        highlight=False,
    )
    table = Table(box=None, show_header=False, pad_edge=False)
    for col in ("state", "server", "version", "verified"):
        table.add_column(col, overflow="fold")
    for s in result.servers:
        state = (
            "[green]ok[/green]" if s.ok else f"[red]FAILED[/red] at {escape(str(s.failed_stage))}"
        )
        version = "" if s.old_version is None else f"{s.old_version} -> {s.weight_version}"
        verified = {None: "", True: "[green]verified[/green]", False: "[red]differs[/red]"}
        table.add_row(state, s.url, version, verified[s.verified])
    console.print(table)


def moved(result: outcome.SyncResult) -> str:
    """Bytes and speed for a tensor push; for a disk push the servers read the files
    themselves, so the client has no byte count: tensors and seconds instead."""
    push_s = result.timings.get("push", 0.0)
    if not any(s.num_buckets or s.num_tensors for s in result.servers):
        return "nothing was pushed"
    if result.transport == "disk":
        tensors = max((s.num_tensors for s in result.servers), default=0)
        return f"the servers read {tensors} tensors from {result.checkpoint} in {push_s:.2f} s"
    if result.transport == "delta":  # grctl push --delta: each server read its delta's files
        tensors = max((s.num_tensors for s in result.servers), default=0)
        wire = max((s.num_bytes for s in result.servers), default=0)
        return f"a delta of {tensors} changed tensors ({fmt_bytes(wire)}) in {push_s:.2f} s"
    return (
        f"{result.num_buckets} bucket(s), {fmt_bytes(result.num_bytes)} in {push_s:.2f} s"
        f" ({fmt_rate(result.push_gbps * 1e9)})"
    )


def sync_details(console: Console, result: outcome.SyncResult) -> None:
    """--verbose: the summary, then every server's buckets, bytes, tensors, error and seconds
    per stage, as a block of `key value` lines (readable at 80 columns)."""
    sync_lines(console, result)
    for s in result.servers:
        table = Table(box=None, show_header=False, title=s.url, title_justify="left")
        table.add_column("key", style="bold")
        table.add_column("value", overflow="fold")
        stage, error = escape(str(s.failed_stage)), escape(str(s.error))
        failed = f"[red]{stage} failed[/red] ({error}); {escape(s.left_as())}"
        table.add_row("outcome", "[green]ok[/green]" if s.ok else failed)
        table.add_row("version", f"{s.old_version} -> {s.weight_version}")
        table.add_row("device", f"{s.device} {s.dtype}")
        moved = f"{s.num_buckets} bucket(s), {fmt_bytes(s.num_bytes)}, {s.num_tensors} tensors"
        if result.transport == "disk":  # the server read the files: no bytes through here
            moved = f"{s.num_tensors} tensors, read by the server"
        table.add_row("applied", moved)
        verified = {None: "not checked", True: "every tensor's sha256 matches", False: "NO"}
        table.add_row("verified", verified[s.verified] + "".join(f"\n{m}" for m in s.mismatches))
        stages = ", ".join(f"{k} {s.timings[k]:.3f}" for k in outcome.STAGES if k in s.timings)
        table.add_row("seconds", stages)
        console.print(table)


def interrupted_report(result: outcome.SyncResult, finish) -> str:
    """Per server: the state a stopped sync left, and the command that finishes the job."""
    lines = [f"push interrupted ({result.interrupted_by}); state left on each server:"]
    for s in result.servers:
        lines.append(f"  {s.url}: {s.left_state()}")
        if s.is_partial:
            lines.append(f"    partly updated, left paused; to finish: {finish(s.url)}")
    return "\n".join(lines)


def finish_hint(urls: list[str], finish) -> str:
    lines = ["partly updated servers were left paused; to finish the job:"]
    lines += [f"  {finish(url)}" for url in urls]
    return "\n".join(lines)


def replies_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    """One row per server: the reply (a Struct or an error text)."""
    table = Table(title=title, title_justify="left")
    table.add_column("server")
    table.add_column("reply", overflow="fold")
    for url, reply in rows:
        table.add_row(url, reply if isinstance(reply, str) else _struct_text(reply))
    return table


def _struct_text(obj: Any) -> str:
    fields = getattr(obj, "__struct_fields__", ())
    return ", ".join(f"{f}={getattr(obj, f)!r}" for f in fields) if fields else repr(obj)


def status_view(url: str, status: ServerStatus) -> Table:
    """/status in a few lines, each fact once (`--json` has every key)."""
    sched = status.sections.get("scheduler", {})
    reqs = status.sections.get("requests", {})
    cache = status.sections.get("prefill_cache", {})
    eng = status.sections.get("engine", {})
    w = status.weights
    paused = sched.get("paused")
    state = f"[yellow]paused ({sched.get('pause_mode')})[/yellow]" if paused else "serving"
    if w.weights_torn or not eng.get("weights_consistent", True):
        torn = f"{len(w.torn_tensors)} tensors " if w.torn_tensors else ""
        state = f"[red]weights inconsistent: {torn}torn by a failed copy (write them again)[/red]"
    elif w.weights_mixed:
        state = "[red]weights mixed (finish the sync or relabel)[/red]"
    last_ms = w.last_weight_update_ms
    table = Table(box=None, show_header=False, title=f"{url}: {state}", title_justify="left")
    table.add_column("part", style="bold")
    table.add_column("facts", overflow="fold")
    step = "" if w.token_step is None else f", token_step {w.token_step}"
    mix = escape(", ".join(f"{label}: {n}" for label, n in w.label_counts.items()))
    table.add_row(
        "weights",
        f"version {escape(w.weight_version)}{escape(step)}, {w.weight_update_count} update(s)"
        + ("" if last_ms is None else f", last took {last_ms:.0f} ms")
        + (f"; [red]tensors by label {mix}[/red]" if w.weights_mixed else ""),
    )
    table.add_row(
        "requests",
        f"{sched.get('num_running', 0)} running ({sched.get('running_beams', 0)} beams), "
        f"{sched.get('num_waiting', 0)} waiting; {reqs.get('succeeded', 0)} done, "
        f"{reqs.get('aborted', 0)} aborted, avg {reqs.get('latency_s_avg', 0.0):.3f} s",
    )
    if cache.get("enabled"):
        facts = (
            f"{cache.get('entries', 0)} entries, {cache.get('tokens', 0)} tokens; "
            f"{cache.get('hits', 0)} hits, {cache.get('misses', 0)} misses"
        )
    else:
        facts = "off"
    table.add_row("prefill cache", facts)
    catalog = status.sections.get("catalog") or {}
    if catalog.get("loaded"):
        table.add_row(
            "catalog",
            f"version {catalog.get('version')}, {catalog.get('num_items', 0)} items"
            f" ({catalog.get('source')})",
        )
    graphs = "cuda graphs on" if eng.get("cuda_graph", {}).get("enabled") else "eager"
    errors = eng.get("errors", 0)
    table.add_row(
        "engine",
        f"{eng.get('device')} {eng.get('dtype')}, {graphs}, up {eng.get('uptime_s', 0):.0f} s"
        + (
            f", [red]{errors} error(s): {escape(str(eng.get('last_error')))}[/red]"
            if errors
            else ""
        ),
    )
    return table


# catalog reply field -> column header (short, so a row fits 80 columns)
CATALOG_COLUMNS = {"version": "version", "num_items": "items", "num_paths": "paths",
                   "max_depth": "depth", "nbytes": "bytes", "source": "source"}  # fmt: skip


def catalog_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    """One row per server: the catalog it serves."""
    table = Table(title=title)
    table.add_column("server", overflow="fold")
    for header in CATALOG_COLUMNS.values():
        table.add_column(header, overflow="fold")
    for url, reply in rows:
        table.add_row(url, *(Text(str(getattr(reply, k, ""))) for k in CATALOG_COLUMNS))
    return table


def checks_table(title: str, checks: dict[str, Any]) -> Table:
    """`catalog validate`: one row per check, a dict or list value as JSON."""
    table = Table(title=title)
    table.add_column("check")
    table.add_column("value")
    for k, v in checks.items():
        table.add_row(k, Text(json.dumps(v) if isinstance(v, (dict, list)) else str(v)))
    return table
