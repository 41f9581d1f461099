"""`grctl serve`: one option per ServeConfig knob, derived from its declaration (grctl/knobs.py).

Nothing here names a knob: adding a field to EngineConfig or ServeConfig adds its flag, its
GR_<FLAG> variable and its line in `grctl serve --help`.
"""

from __future__ import annotations

import inspect
import typing
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from grctl.config import ServeConfig
from grctl.engine.config import EngineConfig
from grctl.knobs import PANELS, env_names, flag_name, is_bytes, parse_bytes

OLD_ENV = sorted(name for _, k in ServeConfig.knobs() for name in k.old_env)
SERVE_HELP = (
    "Serve a model over HTTP with SGLang-compatible routes.\n\n"
    "Every flag can also be set by the environment variable GR_<FLAG>, the flag's name in"
    " capitals (--max-running-requests: GR_MAX_RUNNING_REQUESTS); a flag given on the command"
    f" line wins. Older names still read: {', '.join(OLD_ENV)}."
)
# Metavars short enough that every flag name fits beside them at 80 columns.
METAVARS = {int: "INT", float: "NUM", str: "TEXT"}


def serve_parameters() -> list[inspect.Parameter]:
    hints = {**typing.get_type_hints(EngineConfig), **typing.get_type_hints(ServeConfig)}
    params = []
    for f, k in sorted(ServeConfig.knobs(), key=lambda fk: PANELS.index(fk[1].panel)):
        flag = flag_name(f.name)
        base: Any = hints[f.name]
        if f.default is None:  # `X | None`, spelled the way Typer reads it
            base = typing.get_args(base)[0]
        annotation: Any = Optional[base] if f.default is None else base
        decls = [flag]
        sized = is_bytes(f.name) and base is int  # 8GiB as well as 8589934592
        if annotation is bool and f.default is True:
            decls = [flag] if k.off_flags else [f"{flag}/--no-{flag[2:]}"]
        opt = typer.Option(
            *decls,
            envvar=env_names(f.name, k),
            help=escape(k.help),  # "[beams, vocab]" is text, not Rich markup
            rich_help_panel=k.panel,
            show_default=f.default is not None and annotation is not bool,
            show_envvar=False,  # SERVE_HELP states the rule once
            metavar="BYTES" if sized else METAVARS.get(base),
            **({"parser": bytes_flag} if sized else {} if k.min is None else {"min": k.min}),
        )
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=f.default,
                annotation=Annotated[annotation, opt],
            )
        )
        params += alias_parameters(f.name, k.aliases, base, sized)
        if k.off_flags:
            off = typer.Option(*k.off_flags, hidden=True)
            params.append(
                inspect.Parameter(
                    f"{OFF_PREFIX}{f.name}",
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None,
                    annotation=Annotated[Optional[bool], off],
                )
            )
    return params


ALIAS_PREFIX = "alias__"
OFF_PREFIX = "off__"


def bytes_flag(text: str) -> int:
    """A byte-size flag's value (knobs.parse_bytes); a bad one is a usage error saying why."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def alias_parameters(
    name: str, aliases: tuple[str, ...], base: Any, sized: bool = False
) -> list[inspect.Parameter]:
    """Each alias is a hidden option of its own, so --help shows the one name in full."""
    kw: dict[str, Any] = {"parser": bytes_flag} if sized else {}
    return [
        inspect.Parameter(
            f"{ALIAS_PREFIX}{i}__{name}",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[Optional[base], typer.Option(alias, hidden=True, **kw)],
        )
        for i, alias in enumerate(aliases)
    ]


CONFIG_NAME = "config_file"


def config_parameter() -> inspect.Parameter:
    opt = typer.Option(
        "--config",
        metavar="FILE",
        is_eager=True,  # read first: its values become the other flags' defaults
        callback=read_config,
        help="YAML or TOML file of flags (keys: flag names); the command line and GR_<FLAG> win.",
        rich_help_panel=PANELS[0],
    )
    return inspect.Parameter(
        CONFIG_NAME,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[Optional[str], opt],
    )


def read_config(ctx: typer.Context, path: str | None) -> str | None:
    """Load --config FILE (.toml, else YAML) into the command's defaults: a key is a flag's
    name with or without its dashes (`max-kv-bytes`, `max_kv_bytes`), a value what the flag
    takes (`8GiB`, true)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        if path.endswith(".toml"):
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            doc = tomllib.loads(raw.decode())
        else:
            import yaml

            doc = yaml.safe_load(raw)
    except Exception as exc:  # unreadable, or not TOML / YAML: say which and why
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="--config") from None
    if not isinstance(doc, dict):
        raise typer.BadParameter(f"{path} must map flag names to values", param_hint="--config")
    known = {f.name for f, _ in ServeConfig.knobs()}
    defaults = {}
    for key, value in doc.items():
        name = str(key).removeprefix("--").replace("-", "_")
        if name not in known:
            raise typer.BadParameter(
                f"{path}: unknown flag {key!r} (see grctl serve --help)", param_hint="--config"
            )
        defaults[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


def serve(**values: Any) -> None:
    from grctl.server.serve import serve as run_server

    values.pop(CONFIG_NAME, None)  # read into the defaults already (read_config)

    for key in [k for k in values if k.startswith(ALIAS_PREFIX)]:
        value = values.pop(key)
        if value is not None:  # an alias given on the command line sets its knob
            values[key.split("__", 2)[2]] = value
    for key in [k for k in values if k.startswith(OFF_PREFIX)]:
        if values.pop(key):  # an off flag given on the command line
            values[key.removeprefix(OFF_PREFIX)] = False
    run_server(ServeConfig.from_flags(values))


serve.__signature__ = inspect.Signature([config_parameter(), *serve_parameters()])  # type: ignore[attr-defined]
serve.__annotations__ = {p.name: p.annotation for p in serve.__signature__.parameters.values()}
serve.__doc__ = SERVE_HELP
