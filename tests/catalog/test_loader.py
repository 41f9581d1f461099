"""The catalog reader, block by block (catalog/loader.py): rows that cross block boundaries,
errors named by their line in a later block, ids mixed across blocks, and files that are no
catalog refused at their first block, against json.loads of each line."""

from __future__ import annotations

import json
import random
import time
import tracemalloc

import numpy as np
import pytest

from grctl.catalog import loader
from grctl.catalog.loader import BLOCK_BYTES, MAX_LINE_BYTES, parse_catalog, read_catalog
from grctl.errors import ValidationError


def lines_of(seed: int, num: int, ids=lambda i: i) -> list[str]:
    """Rows of varied length (metadata up to 3 KB), some blank lines, some CRLF endings."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        row = {
            "item_id": ids(i),
            "token_ids": [rng.randrange(5000) for _ in range(rng.randint(1, 6))],
        }
        if rng.random() < 0.3:
            row["metadata"] = {"title": "x" * rng.randrange(3000)}
        out.append(json.dumps(row) + ("\r" if rng.random() < 0.1 else ""))
        if rng.random() < 0.05:
            out.append(" " * rng.randrange(3))
    return out


def expected(lines: list[str]) -> tuple[list[list[int]], list]:
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r["token_ids"] for r in rows], [r["item_id"] for r in rows]


def paths_of(parsed) -> list[list[int]]:
    return [p[:n].tolist() for p, n in zip(parsed.paths, parsed.lengths, strict=True)]


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_rows_across_many_blocks_equal_json_loads(tmp_path, trailing_newline):
    lines = lines_of(0, 6000)
    data = ("\n".join(lines) + ("\n" if trailing_newline else "")).encode()
    assert len(data) > 8 * BLOCK_BYTES  # rows cross block boundaries
    path = tmp_path / "c.jsonl"
    path.write_bytes(data)
    want_paths, want_ids = expected(lines)
    for parsed in (read_catalog(str(path), vocab_size=5000), parse_catalog(data)):
        assert paths_of(parsed) == want_paths
        assert [parsed.ids.get(i) for i in range(len(want_ids))] == want_ids
        assert parsed.ids.ints is not None and parsed.file_bytes == len(data)


def test_ids_mixed_across_blocks_come_back_as_strings():
    """A string id in the last block turns every id, those of the earlier blocks too, into a
    string (as for a catalog decoded whole)."""
    lines = lines_of(1, 4000, ids=lambda i: "last" if i == 3999 else i)
    parsed = parse_catalog("\n".join(lines).encode())
    want = [str(i) for i in expected(lines)[1]]
    assert parsed.ids.ints is None
    assert [parsed.ids.get(i) for i in range(len(want))] == want


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("{oops", "JSON is malformed"),
        ('{"item_id": 1}', "token_ids"),
        ('{"item_id": 1, "token_ids": []}', "an empty token_ids"),
        ('{"item_id": 1, "token_ids": [5000]}', "token id 5000 is outside [0, 5000)"),
        ('{"item_id": 1, "token_ids": [-1]}', "token id -1"),
        ('{"item_id": 1, "token_ids": [18446744073709551615]}', "token id 18446744073709551615"),
    ],
)
def test_an_error_in_a_later_block_names_its_line(bad, needle):
    lines = lines_of(2, 5000)
    at = 4321  # far past the first block; blank lines before it counted too
    lines.insert(at, bad)
    data = "\n".join(lines).encode()
    assert data.index(bad.encode()) > 4 * BLOCK_BYTES
    with pytest.raises(ValidationError, match=f"line {at + 1}") as err:
        parse_catalog(data, vocab_size=5000)
    assert needle in str(err.value), str(err.value)


def refused(path, match: str) -> tuple[float, int]:
    """(seconds, peak traced bytes) of reading `path` to its refusal; the file is removed (a
    sparse gigabyte: pytest keeps its last temp dirs)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValidationError, match=match):
            read_catalog(str(path), max_bytes=2**30)
        return time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        path.unlink()


def test_a_gigabyte_of_zeros_is_refused_at_once(tmp_path):
    """A 1 GB zero-filled file (sparse: no disk used) is one endless line: refused once a line
    passes MAX_LINE_BYTES, having read a few blocks (it took 19 s and +2.9 GiB, reading and
    copying the whole file before decoding it)."""
    path = tmp_path / "zeros.jsonl"
    with open(path, "wb") as f:
        f.truncate(10**9)
    took, peak = refused(path, f"line 1 is longer than {MAX_LINE_BYTES} bytes")
    assert peak < 4 * MAX_LINE_BYTES, peak
    assert took < 2.0, took


def test_garbage_lines_are_refused_at_the_first_block(tmp_path):
    """A gigabyte that starts with lines of garbage: the first block's error, nothing more read."""
    path = tmp_path / "garbage.jsonl"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(b"\n".join(rng.integers(33, 127, 200, np.uint8).tobytes() for _ in range(100)))
        f.truncate(10**9)
    took, peak = refused(path, "line 1: JSON is malformed")
    assert peak < 4 * BLOCK_BYTES, peak
    assert took < 2.0, took


def test_a_long_line_in_a_later_block_is_refused_naming_it(monkeypatch):
    """A line still unfinished after MAX_LINE_BYTES is refused, named, whatever block it is in
    (small blocks here: the same rows parse as with the default ones)."""
    monkeypatch.setattr(loader, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(loader, "MAX_LINE_BYTES", 10_000)
    lines = lines_of(3, 2000)
    parsed = parse_catalog("\n".join(lines).encode())
    assert paths_of(parsed) == expected(lines)[0]
    lines.insert(
        1500, '{"item_id": 1, "token_ids": [1], "metadata": {"t": "' + "y" * 50_000 + '"}}'
    )
    with pytest.raises(ValidationError, match="line 1501 is longer than 10000 bytes"):
        parse_catalog("\n".join(lines).encode())
