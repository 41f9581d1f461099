"""Reading an item catalog: JSONL rows `{"item_id": str|int, "token_ids": [int, ...], "metadata"?}`.

The whole file is decoded in one msgspec call (the non-blank lines joined into one JSON array);
only when that fails is it decoded line by line, to name the first bad line. Every error a user
can cause is a ValidationError (a 400 validation_error) whose message names the file and the line.
Metadata is checked to be an object and then dropped: responses carry item ids, not metadata.
"""

from __future__ import annotations

import gc
import itertools
import operator
import os
import stat
from dataclasses import dataclass

import msgspec
import numpy as np

from grctl import confined
from grctl.errors import ValidationError

MAX_DEPTH = 64  # tokens in one item path


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
        encoded = [str(i).encode() for i in ids]
        lens = np.fromiter(map(len, encoded), np.int64, len(encoded))
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return cls(None, b"".join(encoded), offsets)

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
    after the route's check of the path is a 403."""
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
    with open(fd, "rb") as f:
        size = st.st_size
        if max_bytes is not None and size > max_bytes:
            raise ValidationError(
                f"catalog {path!r} is {size} bytes, over the limit of {max_bytes} "
                "(--max-catalog-bytes); split it or raise the limit"
            )
        try:
            data = f.read(size + 1)
        except OSError as exc:
            raise ValidationError(f"catalog {path!r} cannot be read: {exc.strerror}") from None
    if len(data) > size:
        raise ValidationError(f"catalog {path!r} grew while being read; reload it once written")
    return parse_catalog(data, source=path, vocab_size=vocab_size)


def _decode(body: bytes) -> list[_Row] | None:
    was_enabled = gc.isenabled()
    gc.disable()  # a million small objects: the cyclic collector would triple the decode time
    try:
        return msgspec.json.decode(body, type=list[_Row])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    finally:
        if was_enabled:
            gc.enable()


def parse_catalog(data: bytes, *, source: str = "<bytes>", vocab_size: int | None = None):
    stripped = data.strip()
    if not stripped:
        raise ValidationError(f"catalog {source!r} has no items; it needs one JSON object per line")
    rows = None
    if b"\n\n" not in stripped and b"\n\r\n" not in stripped:  # the usual file: the fast path
        num_leading = data[: len(data) - len(data.lstrip())].count(b"\n")
        rows = _decode(b"[" + stripped.replace(b"\n", b",") + b"]")

        def line_of(row: int) -> int:
            return row + 1 + num_leading

    if rows is None:  # blank lines somewhere, or an error to locate
        lines = data.split(b"\n")
        keep = [i for i, line in enumerate(lines) if line.strip()]

        def line_of(row: int) -> int:
            return keep[row] + 1

        rows = _decode(b"[" + b",".join(lines[i] for i in keep) + b"]")
        if rows is None:
            _raise_first_bad_line(lines, source)
    token_lists = list(map(operator.attrgetter("token_ids"), rows))
    item_ids = list(map(operator.attrgetter("item_id"), rows))
    del rows
    lengths = np.fromiter(map(len, token_lists), np.int32, len(token_lists))
    bad = np.flatnonzero((lengths == 0) | (lengths > MAX_DEPTH))
    if bad.size:
        n = int(lengths[bad[0]])
        what = "an empty token_ids" if n == 0 else f"{n} tokens (at most {MAX_DEPTH})"
        raise ValidationError(f"catalog {source!r} line {line_of(int(bad[0]))}: {what}")
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, int(lengths.sum()))
    del token_lists
    limit = vocab_size if vocab_size is not None else 2**31 - 1
    out = np.flatnonzero((flat < 0) | (flat >= limit))
    if out.size:
        row = int(np.searchsorted(np.cumsum(lengths), out[0], side="right"))
        where = f"[0, {vocab_size}) (the model's vocabulary)" if vocab_size else "[0, 2**31)"
        raise ValidationError(
            f"catalog {source!r} line {line_of(row)}: token id {int(flat[out[0]])} "
            f"is outside {where}"
        )
    depth = int(lengths.max())
    paths = np.full((len(lengths), depth), -1, np.int32)
    paths[np.arange(depth)[None, :] < lengths[:, None]] = flat
    return CatalogRows(source, len(data), paths, lengths, ItemIds.from_list(item_ids))


def _raise_first_bad_line(lines: list[bytes], source: str) -> None:
    decoder = msgspec.json.Decoder(_Row)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            decoder.decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            hint = ' (each line must be {"item_id": str|int, "token_ids": [int, ...]})'
            raise ValidationError(f"catalog {source!r} line {i + 1}: {exc}{hint}") from None
    raise ValidationError(f"catalog {source!r} is not JSONL: one JSON object per line")
