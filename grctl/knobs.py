"""Knobs: a config field declared once, with its help line, help panel and bounds.

    max_beam_width: int = knob(256, "Largest n (beam width).", "Scheduling", min=1)

Everything else is derived from that one declaration: the `grctl serve` flag is the field name
with dashes (`--max-beam-width`), its environment variable is GR_<FLAG> (`GR_MAX_BEAM_WIDTH`),
and the same bounds and choices are checked when the config is built, from flags or from Python.
A bool that defaults to True also gets its off switch (`--no-cuda-graph`), or the off flags it
names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from grctl.errors import ValidationError

# `grctl serve --help` shows its options in these panels, in this order.
PANELS = ("Model", "Logprobs", "HTTP", "Scheduling", "Prefix cache", "Weight updates", "Catalog")
ENV_PREFIX = "GR_"


@dataclass(frozen=True)
class Knob:
    help: str
    panel: str
    min: int | float | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # more flag names that set it (e.g. another project's name)
    old_env: tuple[str, ...] = ()  # environment names read after GR_<FLAG>, kept working
    # A bool defaulting to True: hidden flags that turn it off, instead of --no-<FLAG> (which
    # would not fit its panel at 80 columns)
    off_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.panel in PANELS, self.panel


def knob(default: Any, help: str, panel: str, **kw: Any) -> Any:
    """A dataclass field carrying its Knob (see the module docstring)."""
    return dataclasses.field(default=default, metadata={"knob": Knob(help, panel, **kw)})


def knobs_of(cls: type) -> Iterator[tuple[dataclasses.Field, Knob]]:
    for f in dataclasses.fields(cls):
        if "knob" in f.metadata:
            yield f, f.metadata["knob"]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def env_names(field_name: str, k: Knob) -> list[str]:
    """GR_<FLAG> first, then the old names this knob was read from."""
    return [env_name(field_name), *k.old_env]


def check_knobs(obj: Any) -> None:
    """Raise ValidationError for the first value outside its knob's bounds or choices."""
    for f, k in knobs_of(type(obj)):
        value = getattr(obj, f.name)
        if k.min is not None and value is not None and value < k.min:
            raise ValidationError(
                f"{f.name} must be at least {k.min}, got {value!r} ({flag_name(f.name)})"
            )
        if k.choices is not None and value not in k.choices:
            listed = ", ".join(k.choices[:-1]) + f" or {k.choices[-1]}"
            raise ValidationError(f"unsupported {f.name} {value!r}; use {listed}")
