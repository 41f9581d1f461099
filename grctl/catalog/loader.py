"""Reading an item catalog: JSONL rows `{"item_id": str|int, "token_ids": [int, ...], "metadata"?}`.

The file is read and decoded a block of whole lines at a time (BLOCK_BYTES, one msgspec call
each, a few milliseconds), each block checked and kept as arrays before the next is read: a
reload in a worker thread never holds the GIL for long (one call over a 2M-item file held it
for over a second, stalling the event loop), and a file that is not a catalog (zeros, garbage,
one endless line) is refused at its first block or at MAX_LINE_BYTES, not after reading it all.
A block that fails is decoded line by line, to name the first bad line. Every error a user can
cause is a ValidationError (a 400 validation_error) whose message names the file and the line.
Metadata is checked to be an object and then dropped: responses carry item ids, not metadata.
"""

from __future__ import annotations

import gc
import itertools
import operator
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NoReturn

import msgspec
import numpy as np

from grctl import confined
from grctl.errors import ValidationError

MAX_DEPTH = 64  # tokens in one item path
BLOCK_BYTES = 1 << 18  # read and decoded at a time (~5 ms of held GIL)
MAX_LINE_BYTES = 1 << 20  # a line still unfinished after these many bytes is refused


class _Row(msgspec.Struct, gc=False, forbid_unknown_fields=False):
    item_id: int | str
    token_ids: list[int]
    metadata: dict | None = None


@dataclass
class CatalogRows:
    """A parsed catalog: item i has path paths[i, :lengths[i]] (padded with -1) and id ids[i]."""

    source: str
    file_bytes: int
    paths: np.ndarray  # [items, max_depth] int32, -1 past each path's end
    lengths: np.ndarray  # [items] int32
    ids: ItemIds


class ItemIds:
    """Item ids without a Python object per item: int64s, or one UTF-8 blob with offsets."""

    def __init__(
        self, ints: np.ndarray | None, blob: bytes = b"", offsets: np.ndarray | None = None
    ):
        self.ints = ints
        self.blob = blob
        self.offsets = offsets

    @classmethod
    def from_list(cls, ids: list[int | str]) -> ItemIds:
        if set(map(type, ids)) == {int}:
            try:
                return cls(np.fromiter(ids, np.int64, len(ids)))
            except OverflowError:
                pass  # ints past 64 bits: kept as their decimal strings
        return cls.of_strings(ids)

    @classmethod
    def of_strings(cls, ids: list[int | str]) -> ItemIds:
        """Every id as a string (an int as its decimal digits)."""
        encoded = [str(i).encode() for i in ids]
        lens = np.fromiter(map(len, encoded), np.int64, len(encoded))
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return cls(None, b"".join(encoded), offsets)

    @classmethod
    def joined(cls, parts: list[ItemIds]) -> ItemIds:
        """The ids of consecutive parts: ints if every part's are, strings otherwise."""
        if all(p.ints is not None for p in parts):
            return cls(np.concatenate([p.ints for p in parts]))
        parts = [p if p.ints is None else cls.of_strings(p.ints.tolist()) for p in parts]
        lens = np.concatenate([np.diff(p.offsets) for p in parts])
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return cls(None, b"".join(p.blob for p in parts), offsets)

    def __len__(self) -> int:
        return len(self.ints) if self.ints is not None else len(self.offsets) - 1

    def get(self, i: int) -> int | str:
        if self.ints is not None:
            return int(self.ints[i])
        return self.blob[self.offsets[i] : self.offsets[i + 1]].decode()

    @property
    def nbytes(self) -> int:
        if self.ints is not None:
            return self.ints.nbytes
        return len(self.blob) + self.offsets.nbytes


def read_catalog(
    path: str,
    *,
    max_bytes: int | None = None,
    vocab_size: int | None = None,
    root: str | None = None,
):
    """Parse and check a catalog file -> CatalogRows. Raises ValidationError naming the line.

    Only a regular file is read, and its size is checked before any byte is: a FIFO would
    block the reload forever (opened without blocking, then refused), and a device such as
    /dev/zero reports size 0 and never ends. With a `root` (--weights-root) the file opened
    must lie inside it, checked through its descriptor (confined.py): a symlink swapped in
    after the route's check of the path is a 403. The file is read and decoded BLOCK_BYTES
    at a time, so a file that is not a catalog is refused at its first block."""
    try:
        fd = confined.open_read(path, root=root, what="catalog", follow=True)
    except OSError as exc:
        raise ValidationError(f"catalog {path!r} cannot be read: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValidationError(
            f"catalog {path!r} is not a regular file", hint="give the path of a JSONL file"
        )
    with open(fd, "rb", buffering=0) as f:
        size = st.st_size
        if max_bytes is not None and size > max_bytes:
            raise ValidationError(
                f"catalog {path!r} is {size} bytes, over the limit of {max_bytes} "
                "(--max-catalog-bytes); split it or raise the limit"
            )
        rows = _parse_blocks(_file_blocks(f, path, size), path, vocab_size)
    return rows


def parse_catalog(data: bytes, *, source: str = "<bytes>", vocab_size: int | None = None):
    """The same checks on a catalog's bytes (JSON lines) -> CatalogRows."""
    view = memoryview(data)
    blocks = (view[i : i + BLOCK_BYTES] for i in range(0, len(data), BLOCK_BYTES))
    return _parse_blocks(blocks, source, vocab_size)


def _file_blocks(f, path: str, size: int) -> Iterator[bytes]:
    """The file's bytes, BLOCK_BYTES at a time; it may not grow past `size` while read."""
    total = 0
    while True:
        try:
            block = f.read(min(BLOCK_BYTES, size + 1 - total))
        except OSError as exc:
            raise ValidationError(f"catalog {path!r} cannot be read: {exc.strerror}") from None
        if not block:
            return
        total += len(block)
        if total > size:
            raise ValidationError(f"catalog {path!r} grew while being read; reload it once written")
        yield block


@dataclass
class _Block:
    """Whole lines of the file, parsed and checked: their paths flattened, lengths, ids."""

    flat: np.ndarray  # [tokens] int32
    lengths: np.ndarray  # [rows] int32
    ids: ItemIds
    num_lines: int


def _parse_blocks(blocks: Iterable[bytes], source: str, vocab_size: int | None) -> CatalogRows:
    """Whole lines are cut from the blocks and decoded a block at a time (one msgspec call, a
    few milliseconds each: a reload in a worker thread lets the event loop run between them,
    where one call over the whole file held the GIL for a second or more), checked, and kept
    as arrays; a line still unfinished after MAX_LINE_BYTES is refused (what is held of the
    file is one block and one line).

    The cyclic collector is off meanwhile (the rows are freed by reference counting, block by
    block): each block's thousands of lists, alive when a collection came, pushed the collector
    into full collections of every object in the process, 200 ms of held GIL each."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _parsed(blocks, source, vocab_size)
    finally:
        if was_enabled:
            gc.enable()


def _parsed(blocks: Iterable[bytes], source: str, vocab_size: int | None) -> CatalogRows:
    decoder = msgspec.json.Decoder(_Row)
    parsed: list[_Block] = []
    tail, line_base, file_bytes = b"", 0, 0  # line_base: lines before the block's first
    for block in blocks:
        file_bytes += len(block)
        buf = tail + block if tail else bytes(block)
        cut = buf.rfind(b"\n") + 1
        tail = buf[cut:]
        if len(tail) > MAX_LINE_BYTES:
            _refuse_long_line(source, line_base + buf.count(b"\n", 0, cut) + 1)
        if cut:
            parsed.append(_parse_lines(decoder, buf[:cut], line_base, source, vocab_size))
            line_base += parsed[-1].num_lines
    if tail.strip():
        parsed.append(_parse_lines(decoder, tail, line_base, source, vocab_size))
    parsed = [b for b in parsed if b.lengths.size]
    if not parsed:
        raise ValidationError(f"catalog {source!r} has no items; it needs one JSON object per line")
    lengths = np.concatenate([b.lengths for b in parsed])
    flat = np.concatenate([b.flat for b in parsed])
    ids = ItemIds.joined([b.ids for b in parsed])
    del parsed
    depth = int(lengths.max())
    paths = np.full((len(lengths), depth), -1, np.int32)
    paths[np.arange(depth)[None, :] < lengths[:, None]] = flat
    return CatalogRows(source, file_bytes, paths, lengths, ids)


def _parse_lines(
    decoder: msgspec.json.Decoder, part: bytes, line_base: int, source: str, vocab_size: int | None
) -> _Block:
    """Decode and check whole lines (the file's lines line_base + 1 on)."""
    try:
        rows = decoder.decode_lines(part)
    except (msgspec.ValidationError, msgspec.DecodeError):
        _raise_first_bad_line(decoder, part, line_base, source)

    def line_of(row: int) -> int:  # only on an error: the row's line in the file
        lines = part.split(b"\n")
        return line_base + [i for i, line in enumerate(lines) if line.strip()][row] + 1

    token_lists = list(map(operator.attrgetter("token_ids"), rows))
    item_ids = list(map(operator.attrgetter("item_id"), rows))
    del rows
    lengths = np.fromiter(map(len, token_lists), np.int32, len(token_lists))
    bad = np.flatnonzero((lengths == 0) | (lengths > MAX_DEPTH))
    if bad.size:
        n = int(lengths[bad[0]])
        what = "an empty token_ids" if n == 0 else f"{n} tokens (at most {MAX_DEPTH})"
        raise ValidationError(f"catalog {source!r} line {line_of(int(bad[0]))}: {what}")
    try:
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, int(lengths.sum()))
    except OverflowError:  # a token id past 64 bits
        row, token = next(
            (r, t) for r, ts in enumerate(token_lists) for t in ts if not -(2**63) <= t < 2**63
        )
        _refuse_token(source, line_of(row), token, vocab_size)
    del token_lists
    limit = vocab_size if vocab_size is not None else 2**31 - 1
    out = np.flatnonzero((flat < 0) | (flat >= limit))
    if out.size:
        row = int(np.searchsorted(np.cumsum(lengths), out[0], side="right"))
        _refuse_token(source, line_of(row), int(flat[out[0]]), vocab_size)
    ids = ItemIds.from_list(item_ids)
    return _Block(flat.astype(np.int32), lengths, ids, part.count(b"\n"))


def _refuse_token(source: str, line: int, token: int, vocab_size: int | None) -> NoReturn:
    where = f"[0, {vocab_size}) (the model's vocabulary)" if vocab_size else "[0, 2**31)"
    raise ValidationError(f"catalog {source!r} line {line}: token id {token} is outside {where}")


def _refuse_long_line(source: str, line: int) -> NoReturn:
    raise ValidationError(
        f"catalog {source!r} line {line} is longer than {MAX_LINE_BYTES} bytes: not a catalog line",
        hint='each line must be {"item_id": str|int, "token_ids": [int, ...]}',
    )


def _raise_first_bad_line(
    decoder: msgspec.json.Decoder, part: bytes, line_base: int, source: str
) -> NoReturn:
    for i, line in enumerate(part.split(b"\n")):
        if not line.strip():
            continue
        try:
            decoder.decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            hint = ' (each line must be {"item_id": str|int, "token_ids": [int, ...]})'
            line_no = line_base + i + 1
            raise ValidationError(f"catalog {source!r} line {line_no}: {exc}{hint}") from None
    raise ValidationError(f"catalog {source!r} is not JSONL: one JSON object per line")
