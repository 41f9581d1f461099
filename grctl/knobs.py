"""Knobs: a config field declared once, with its help line, help panel and bounds.

    max_beam_width: int = knob(1024, "Largest n (beam width).", "Scheduling", min=1)

Everything else is derived from that one declaration: the `grctl serve` flag is the field name
with dashes (`--max-beam-width`), its environment variable is GR_<FLAG> (`GR_MAX_BEAM_WIDTH`),
and the same bounds and choices are checked when the config is built, from flags or from Python.
A bool that defaults to True also gets its off switch (`--no-cuda-graph`), or the off flags it
names. An int knob named `*_bytes` takes a byte size on the command line and in GR_<FLAG>: an
integer, or one with a suffix (`8GiB`, `512MiB`, `1.5GB`; parse_bytes).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
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


BYTE_UNITS = {
    "": 1,
    "b": 1,
    **{p.lower() + "b": 1000**i for i, p in enumerate("KMGTP", 1)},
    **{p.lower() + "ib": 1024**i for i, p in enumerate("KMGTP", 1)},
}


def is_bytes(field_name: str) -> bool:
    """A knob whose value is a number of bytes (parse_bytes reads its flag)."""
    return field_name.endswith("_bytes")


def parse_bytes(text: object) -> int:
    """A byte size: an integer, or a number with a suffix, KB/MB/GB/TB/PB (powers of 1000) or
    KiB/MiB/GiB/TiB/PiB (powers of 1024), any case: "8GiB" -> 8589934592."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if unit not in BYTE_UNITS:
        raise ValueError(
            f"{text!r} is not a byte size: an integer, or one with a suffix (512MiB, 8GiB, 1.5GB)"
        )
    return int(Fraction(m.group(1)) * BYTE_UNITS[unit])


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
