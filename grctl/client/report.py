"""Rich output for the client commands: the push progress bar and the summary tables."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
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

from grctl.client import outcome
from grctl.client.types import Status


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
        label = "pushing tensors" if transport == "tensor" else "loading from disk (server side)"
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


def sync_table(result: outcome.SyncResult) -> Table:
    title = (
        f"push {result.transport} -> version {result.weight_version or '(label unchanged)'}: "
        f"{result.num_buckets} bucket(s), {fmt_bytes(result.num_bytes)}, "
        f"{result.push_gbps:.3f} GB/s, {result.timings.get('total', 0.0):.2f} s"
    )
    table = Table(title=title, title_justify="left")
    for col in ("server", "outcome", "version", "buckets", "bytes", "tensors", "verified"):
        table.add_column(col, overflow="fold")
    for stage in outcome.STAGES[1:]:
        table.add_column(f"{stage} s", justify="right")
    for s in result.servers:
        state = "[green]ok[/green]" if s.ok else f"[red]{s.failed_stage} failed[/red]: {s.error}"
        version = f"{s.old_version} -> {s.weight_version}"
        verified = {None: "-", True: "[green]yes[/green]", False: "[red]no[/red]"}[s.verified]
        stages = [f"{s.timings[k]:.3f}" if k in s.timings else "-" for k in outcome.STAGES[1:]]
        table.add_row(
            s.url,
            state,
            version,
            str(s.num_buckets),
            fmt_bytes(s.num_bytes),
            str(s.num_tensors),
            verified,
            *stages,
        )
    return table


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


def status_table(url: str, status: Status) -> Table:
    table = Table(title=f"{url} /status", title_justify="left")
    table.add_column("section", style="bold")
    table.add_column("key")
    table.add_column("value", overflow="fold")
    sections = {
        "weights": {f: getattr(status.weights, f) for f in status.weights.__struct_fields__}
    }
    sections.update(status.sections)
    for section, values in sections.items():
        if not isinstance(values, dict):
            table.add_row(section, "", _value(values))
            continue
        for i, (key, value) in enumerate(values.items()):
            table.add_row(section if i == 0 else "", key, _value(value))
    return table


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return v if isinstance(v, str) else json.dumps(v)
