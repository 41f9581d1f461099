"""OpenOneRec's semantic IDs as catalog rows (docs/catalog.md, "OpenOneRec's semantic IDs").

OpenOneRec spells an item as text, `<|sid_begin|><s_a_340><s_b_6566><s_c_5603><|sid_end|>`: one
added token per level (`<s_a_{code}>`, `<s_b_{code}>`, ...) between two delimiters, all added to
Qwen3's vocabulary by its vocabulary expansion. Its tables map a product id (pid) to that SID, as
the text or as the list of codes (`[340, 6566, 5603]`, its `pid2sid` parquet files). Here a table
becomes CatalogRows: each pid's path is its level tokens' ids in the served vocabulary, then
`<|sid_end|>` (so every item stage ends by closing the item), optionally `<|sid_begin|>` first.
The vocabulary is a mapping token string -> id (the tokenizer's, read by the caller): a level
token it lacks is an error naming the pid, never a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from grctl.catalog.loader import MAX_DEPTH, CatalogRows, ItemIds
from grctl.errors import ValidationError

SID_BEGIN = "<|sid_begin|>"
SID_END = "<|sid_end|>"
MAX_LEVELS = 26  # levels are the letters a..z
_SID_TEXT = re.compile(r"(?:<\|sid_begin\|>)?((?:<s_[a-z]_\d{1,9}>)+)(?:<\|sid_end\|>)?")
_LEVEL = re.compile(r"<s_([a-z])_(\d+)>")


def level_token(level: int, code: int) -> str:
    """The token of `code` at `level` (0 is `a`): `<s_a_{code}>`."""
    return f"<s_{chr(ord('a') + level)}_{code}>"


def sid_codes(sid: str | Sequence[int], where: str = "") -> list[int]:
    """The codes of one SID, given as OpenOneRec's text (the delimiters optional, surrounding
    whitespace ignored) or as the list of codes. Raises ValidationError naming `where`."""
    if isinstance(sid, str):
        match = _SID_TEXT.fullmatch(sid.strip())
        if match is None:
            raise ValidationError(
                f"{where}SID {sid[:80]!r} is not OpenOneRec's form",
                hint="write it as <|sid_begin|><s_a_1><s_b_2><s_c_3><|sid_end|>",
            )
        levels = _LEVEL.findall(match.group(1))
        letters = "".join(letter for letter, _ in levels)
        if letters != "abcdefghijklmnopqrstuvwxyz"[: len(levels)]:
            raise ValidationError(f"{where}SID {sid[:80]!r}: levels must run a, b, c, ... in order")
        return [int(code) for _, code in levels]
    if isinstance(sid, (list, tuple, np.ndarray)) and all(
        isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in sid
    ):
        codes = [int(c) for c in sid]
        if codes and all(0 <= c < 2**31 for c in codes):
            return codes
    raise ValidationError(
        f"{where}SID {str(sid)[:80]} is neither OpenOneRec's text nor a list of codes (ints >= 0)"
    )


def read_sid_table(path: str | Path) -> list[tuple[int | str, str | list[int]]]:
    """(pid, sid) rows of a pid -> SID table, by the file's suffix:
    `.parquet` (columns `pid` and `sid`, as OpenOneRec's pid2sid files; needs pyarrow),
    `.jsonl` (`{"pid": ..., "sid": ...}` per line), `.json` (one object `{pid: sid}`), or
    `.tsv` / `.txt` (`pid<TAB>sid` per line). A sid is the SID text or its list of codes."""
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise ValidationError(f"SID table {name!r} is not a readable file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            table = json.loads(text)
        except ValueError as exc:
            raise ValidationError(f"SID table {name!r} is not JSON: {exc}") from None
        if not isinstance(table, dict) or not table:
            raise ValidationError(f"SID table {name!r} must be one non-empty object {{pid: sid}}")
        return [(_pid(k), v) for k, v in table.items()]
    rows: list[tuple[int | str, str | list[int]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if suffix == ".jsonl":
            try:
                row = json.loads(line)
                rows.append((_pid(row["pid"]), row["sid"]))
            except (ValueError, TypeError, KeyError):
                raise ValidationError(
                    f"SID table {name!r} line {number}: not an object with `pid` and `sid`"
                ) from None
        elif suffix in (".tsv", ".txt"):
            pid, tab, sid = line.partition("\t")
            if not tab:
                raise ValidationError(f"SID table {name!r} line {number}: no tab after the pid")
            rows.append((_pid(pid.strip()), sid))
        else:
            raise ValidationError(
                f"SID table {name!r}: unknown suffix {suffix!r}",
                hint="use .parquet, .jsonl, .json, .tsv or .txt",
            )
    if not rows:
        raise ValidationError(f"SID table {name!r} has no rows")
    return rows


def _pid(value) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(value)
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def _read_parquet(path: Path) -> list[tuple[int | str, str | list[int]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValidationError(
            f"SID table {str(path)!r} is parquet: reading it needs pyarrow",
            hint="pip install pyarrow, or write the table as .jsonl",
        ) from None
    try:
        table = pq.read_table(path, columns=["pid", "sid"])
    except Exception as exc:  # pyarrow's errors name the missing column or the bad file
        raise ValidationError(f"SID table {str(path)!r}: {exc}") from None
    pids = table.column("pid").to_pylist()
    sids = table.column("sid").to_pylist()
    return [(_pid(p) if isinstance(p, str) else p, s) for p, s in zip(pids, sids, strict=True)]


def sid_catalog(
    table: Sequence[tuple[int | str, str | Sequence[int]]],
    vocab: Mapping[str, int],
    *,
    source: str = "<sids>",
    with_begin: bool = False,
    with_end: bool = True,
) -> CatalogRows:
    """CatalogRows of a pid -> SID table: each path is the SID's level tokens' ids in `vocab`,
    then `<|sid_end|>` (with_end), after `<|sid_begin|>` (with_begin). Raises ValidationError
    naming the first pid whose SID is malformed or whose token `vocab` lacks."""
    if not table:
        raise ValidationError(f"{source}: the SID table has no rows")
    codes = [sid_codes(sid, f"{source} pid {pid!r}: ") for pid, sid in table]
    lengths = np.fromiter(map(len, codes), np.int32, len(codes))
    levels = int(lengths.max())
    extra = int(with_begin) + int(with_end)
    if levels > MAX_LEVELS or levels + extra > MAX_DEPTH:
        raise ValidationError(f"{source}: a SID of {levels} levels (at most {MAX_LEVELS})")
    delimiters = []
    for token, wanted in ((SID_BEGIN, with_begin), (SID_END, with_end)):
        if wanted and token not in vocab:
            raise ValidationError(
                f"{source}: the vocabulary has no {token}",
                hint="expand the tokenizer with OpenOneRec's SID tokens first",
            )
        delimiters.append(vocab[token] if wanted else -1)
    begin, end = delimiters
    padded = np.full((len(codes), levels), -1, np.int64)
    for i, row in enumerate(codes):
        padded[i, : len(row)] = row
    paths = np.full((len(codes), levels + extra), -1, np.int32)
    offset = int(with_begin)
    if with_begin:
        paths[:, 0] = begin
    for level in range(levels):
        col = padded[:, level]
        used = np.flatnonzero(col >= 0)
        uniq, inverse = np.unique(col[used], return_inverse=True)
        ids = np.fromiter(
            (vocab.get(level_token(level, int(c)), -1) for c in uniq), np.int64, len(uniq)
        )
        token_ids = np.full(len(codes), -1, np.int64)
        token_ids[used] = ids[inverse]
        missing = used[token_ids[used] < 0]
        if missing.size:
            i = int(missing[0])
            raise ValidationError(
                f"{source} pid {table[i][0]!r}: the vocabulary has no "
                f"{level_token(level, int(col[i]))}",
                hint="expand the vocabulary to cover every level and code of the table "
                "(OpenOneRec: --itemic_layer_n, --vocab_size_per_layer)",
            )
        paths[:, offset + level] = token_ids
    if with_end:
        paths[np.arange(len(codes)), offset + lengths] = end
    return CatalogRows(
        source,
        0,
        paths,
        (lengths + extra).astype(np.int32),
        ItemIds.from_list([pid for pid, _ in table]),
    )


def sid_text(codes: Sequence[int]) -> str:
    """OpenOneRec's text of one SID: `<|sid_begin|><s_a_..>...<|sid_end|>`."""
    return SID_BEGIN + "".join(level_token(d, c) for d, c in enumerate(codes)) + SID_END


def catalog_lines(rows: CatalogRows) -> bytes:
    """The catalog file of `rows` (loader.py's JSONL), one item per line."""
    out = []
    for i in range(len(rows.lengths)):
        path = rows.paths[i, : rows.lengths[i]].tolist()
        out.append(json.dumps({"item_id": rows.ids.get(i), "token_ids": path}))
    return ("\n".join(out) + "\n").encode()
