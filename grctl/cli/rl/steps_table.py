"""The live table of an RL demo's steps (demo --rl and demo --rl --two-stage): one row per step,
right-aligned figures."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich import box
from rich.table import Table


def steps_table(title: str, columns: Sequence[str], cells: Iterable[Sequence[str]]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    for col in columns:
        table.add_column(col, justify="right", no_wrap=True)
    for row in cells:
        table.add_row(*row)
    return table
