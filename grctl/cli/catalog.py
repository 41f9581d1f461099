"""`grctl catalog status | reload PATH | rollback | validate PATH | from-sids TABLE`.

status, reload and rollback call servers (--url, repeatable; --api-key); validate reads a file
here, with no server: counts, the depth histogram, collisions, items no beam can reach, and
token ids outside the vocabulary (--vocab-size, or the config.json of --model-path); it exits 1
on a file a server would refuse. from-sids writes the catalog of OpenOneRec's pid -> SID table
through a tokenizer (grctl/catalog/sids.py), then validates it. Every command takes --json: one
JSON document on stdout, the shape every client command uses (grctl/cli/output.py; docs/cli.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from grctl.cli.options import ApiKey, Json, Timeout, Urls
from grctl.cli.output import command_output, console
from grctl.cli.report import catalog_table, checks_table
from grctl.cli.servers import Row, each_server, finish
from grctl.errors import ValidationError

catalog_app = typer.Typer(
    help="The item catalog: status, reload and rollback on servers; validate a file here.",
    no_args_is_help=True,
)


def on_servers(name: str, urls, api_key, timeout: float, as_json: bool, call) -> None:
    """Call every server; --json: the shared document (grctl/cli/output.py), else a table."""

    def show(rows: list[Row]) -> None:
        if rows:  # every server failed: the error lines say it all
            console.print(catalog_table(f"catalog {name}", rows))

    with command_output(f"catalog {name}", as_json) as out:
        finish(out, each_server(urls, api_key, timeout, call), show)


@catalog_app.command("status")
def status(url: Urls = None, api_key: ApiKey = None, timeout: Timeout = 30.0, json_: Json = False):
    """The catalog each server serves: version, counts, bytes, source."""
    on_servers("status", url, api_key, timeout, json_, lambda gr: gr.catalog_status())


@catalog_app.command("reload")
def reload(
    path: Annotated[str, typer.Argument(help="The catalog JSONL, as the server sees its path.")],
    url: Urls = None,
    api_key: ApiKey = None,
    timeout: Timeout = 300.0,
    json_: Json = False,
):
    """Build the catalog at PATH on each server and serve it (needs --allow-catalog-reload)."""
    on_servers("reload", url, api_key, timeout, json_, lambda gr: gr.catalog_reload(path))


@catalog_app.command("rollback")
def rollback(
    url: Urls = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Even to a catalog of other weights than the served ones (else 409)."
        ),
    ] = False,
    api_key: ApiKey = None,
    timeout: Timeout = 30.0,
    json_: Json = False,
):
    """Serve the catalog from before the last reload again."""
    on_servers("rollback", url, api_key, timeout, json_, lambda gr: gr.catalog_rollback(force))


@catalog_app.command("validate")
def validate(
    path: Annotated[Path, typer.Argument(help="The catalog JSONL to check.")],
    vocab_size: Annotated[
        Optional[int], typer.Option(min=1, help="Token ids must be below this.")
    ] = None,
    model_path: Annotated[
        Optional[Path], typer.Option(help="Read the vocabulary size from its config.json.")
    ] = None,
    json_: Json = False,
):
    """Check a catalog file here (no server); exit 1 if a server would refuse it."""
    report = run_validate(str(path), vocab_size, model_path)
    with command_output("catalog validate", json_) as out:
        out.emit(report, human=lambda: console.print(checks_table(f"catalog {path}", report)))
    if not report["ok"]:
        raise typer.Exit(1)


def run_validate(path: str, vocab_size: int | None, model_path: Path | None) -> dict[str, Any]:
    import torch

    from grctl.catalog.loader import read_catalog
    from grctl.catalog.trie import Trie

    report: dict[str, Any] = {"path": path, "ok": False, "vocab_size": vocab_size}
    try:
        if vocab_size is None and model_path is not None:  # a bad --model-path: the report's error
            report["vocab_size"] = vocab_size = vocab_of(model_path)
        rows = read_catalog(path)
    except ValidationError as exc:
        report["error"] = str(exc)
        return report
    stats = Trie(rows.paths, rows.lengths, torch.device("cpu")).stats
    report.update(
        num_items=stats.num_items,
        num_paths=stats.num_paths,
        num_nodes=stats.num_nodes,
        max_depth=stats.max_depth,
        depth_histogram={str(d): c for d, c in stats.depth_histogram.items()},
        num_collision_paths=stats.num_collision_paths,
        num_collision_items=stats.num_collision_items,
        num_shadowed_items=stats.num_shadowed_items,
        self_delimiting=stats.self_delimiting,
        file_bytes=rows.file_bytes,
    )
    out_of_range = 0
    if vocab_size is not None:
        bad_rows = (rows.paths >= vocab_size).any(axis=1)
        out_of_range = int(bad_rows.sum())
        if out_of_range:  # read again with the limit: its message names the first line
            try:
                read_catalog(path, vocab_size=vocab_size)
            except ValidationError as exc:
                report["error"] = f"{out_of_range} item(s) outside the vocabulary; {exc}"
    report["num_items_out_of_range"] = out_of_range
    report["ok"] = "error" not in report
    return report


def vocab_of(model_path: Path) -> int:
    try:
        raw = json.loads((model_path / "config.json").read_text())
        return int(raw["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        msg = f"cannot read vocab_size from {model_path}/config.json: {exc}"
        raise ValidationError(msg) from None


@catalog_app.command("from-sids")
def from_sids(
    table: Annotated[
        Path, typer.Argument(help="pid -> SID table: .parquet (pid, sid), .jsonl, .json, .tsv.")
    ],
    tokenizer: Annotated[
        Path, typer.Option(help="The expanded model's directory: its tokenizer gives the ids.")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The catalog JSONL to write.")],
    with_begin: Annotated[
        bool, typer.Option(help="Start each path with <|sid_begin|> (off: a forced prefix has it).")
    ] = False,
    with_end: Annotated[bool, typer.Option(help="End each path with <|sid_end|>.")] = True,
    json_: Json = False,
):
    """Write the catalog of OpenOneRec's SIDs: each pid's level tokens, then <|sid_end|>."""
    with command_output("catalog from-sids", json_) as out:
        report = run_from_sids(table, tokenizer, output, with_begin, with_end)
        out.emit(report, human=lambda: console.print(checks_table(f"catalog {output}", report)))
    if not report["ok"]:
        raise typer.Exit(1)


def run_from_sids(
    table: Path, tokenizer: Path, output: Path, with_begin: bool, with_end: bool
) -> dict[str, Any]:
    from grctl.catalog.sids import catalog_lines, read_sid_table, sid_catalog, sid_codes, sid_text

    report: dict[str, Any] = {"table": str(table), "path": str(output), "ok": False}
    try:
        tok = load_tokenizer(tokenizer)
        vocab = tok.get_vocab()
        rows_in = read_sid_table(table)
        rows = sid_catalog(
            rows_in, vocab, source=str(table), with_begin=with_begin, with_end=with_end
        )
        for i, (pid, sid) in enumerate(rows_in[:16]):  # the tokenizer spells each SID so too
            ids = tok.encode(sid_text(sid_codes(sid)), add_special_tokens=False)
            want = rows.paths[i, : rows.lengths[i]].tolist()
            got = ids[int(not with_begin) : len(ids) - int(not with_end)]
            if got != want:
                raise ValidationError(
                    f"the tokenizer of {tokenizer} encodes pid {pid!r}'s SID as {ids}, not as "
                    "one token per level between <|sid_begin|> and <|sid_end|>",
                    hint="add the SID tokens to the tokenizer (tokenizer.add_tokens)",
                )
    except ValidationError as exc:
        report["error"] = str(exc)
        return report
    output.write_bytes(catalog_lines(rows))
    config = tokenizer / "config.json"
    report.update(run_validate(str(output), None, tokenizer if config.is_file() else None))
    report.update(table=str(table), num_levels=int(rows.lengths.max()) - with_begin - with_end)
    return report


def load_tokenizer(path: Path):
    try:
        import transformers
    except ImportError:
        raise ValidationError(
            "reading the tokenizer needs transformers", hint="pip install transformers"
        ) from None

    try:
        return transformers.AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValidationError(f"no tokenizer at {path}: {exc}") from None
