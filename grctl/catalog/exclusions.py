"""Excluded items (a user's history): the trie nodes no beam of a request may enter.

A path is closed when every item on it is excluded, and so is every node whose reachable paths
(a beam stops at the first item it completes, so a path that runs on past an item is not
reachable) are all closed: walking up from each closed path, a beam never enters a prefix that
could only end at excluded items. With min_new_tokens, only the paths deep enough count
(min_length.py closes the rest): a prefix whose long enough items are all excluded is closed
too. The index this needs (the item ids sorted, each row's node, each node's parent and
reachable paths) is built once per catalog, on the first request that excludes anything.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np

from grctl.catalog.min_length import node_depths, node_levels, parents_of
from grctl.errors import ValidationError

if TYPE_CHECKING:
    from grctl.catalog.store import Catalog

_indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Trie -> _Index
_lock = threading.Lock()


class _Index:
    def __init__(self, catalog: Catalog):
        trie, ids = catalog.trie, catalog.ids
        self.is_int = ids.ints is not None
        if self.is_int:
            keys = ids.ints
        else:  # fixed-width bytes: one numpy array, sortable, no Python object per item
            lens = np.diff(ids.offsets)
            width = max(int(lens.max(initial=1)), 1)
            blob = np.frombuffer(ids.blob, np.uint8)
            cols = np.arange(width)
            at = ids.offsets[:-1, None] + cols
            chars = np.where(cols < lens[:, None], blob[np.minimum(at, max(blob.size - 1, 0))], 0)
            keys = np.ascontiguousarray(chars.astype(np.uint8)).view(f"S{width}").ravel()
            self.width = width
        self.order = np.argsort(keys, kind="stable")
        self.sorted = keys[self.order]
        offsets = trie.item_offsets
        self.items_per_node = np.diff(offsets)
        self.node_of_row = np.empty(len(ids), np.int64)
        nodes = np.arange(trie.num_nodes)
        self.node_of_row[trie.item_index] = np.repeat(nodes, self.items_per_node)
        child_offsets = trie.child_offsets.cpu().numpy().astype(np.int64)
        self.child_offsets = child_offsets
        self.parent = parents_of(child_offsets)
        self.depth = node_depths(child_offsets)
        self.terminal = self.items_per_node > 0
        self.reach = _reachable_paths(child_offsets, self.terminal, self.parent)
        self._reach_deep: dict[int, np.ndarray] = {0: self.reach}

    def reach_from(self, min_depth: int) -> np.ndarray:
        """Per node, the reachable paths at depth >= min_depth."""
        reach = self._reach_deep.get(min_depth)
        if reach is None:
            counted = self.terminal & (self.depth >= min_depth)
            reach = _reachable_paths(self.child_offsets, counted, self.parent, self.terminal)
            self._reach_deep[min_depth] = reach
        return reach

    def rows_of(self, item_ids: tuple) -> np.ndarray:
        if self.is_int:
            keys = [k for k in map(_as_int, item_ids) if k is not None]
            query = np.array(keys, np.int64)
        else:
            enc = [str(x).encode() for x in item_ids]
            query = np.array([e for e in enc if len(e) <= self.width], f"S{self.width}")
        lo = np.searchsorted(self.sorted, query, side="left")
        hi = np.searchsorted(self.sorted, query, side="right")
        if not query.size:
            return np.zeros(0, np.int64)
        return self.order[np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)])]


INT64 = (-(2**63), 2**63 - 1)


def _as_int(x: object) -> int | None:
    """An id of an integer catalog (an int or its digits), None for what names no item; one
    past int64 (no item id can be) is a 400."""
    try:
        value = int(x) if not isinstance(x, bool) else None
    except (TypeError, ValueError):  # not digits, or more than Python converts
        return None
    if value is not None and not INT64[0] <= value <= INT64[1]:
        shown = str(x) if len(str(x)) <= 30 else str(x)[:30] + "..."
        raise ValidationError(f"exclude_item_ids holds {shown}, past the int64 range of item ids")
    return value


def _reachable_paths(
    child_offsets: np.ndarray, counted: np.ndarray, parent: np.ndarray, terminal=None
):
    """Per node, the `counted` paths a beam entering it can still complete (an item's node
    counts one: the beam stops there; `terminal`, every item's node, defaults to `counted`).
    Nodes are numbered by depth, so each level is a contiguous range."""
    terminal = counted if terminal is None else terminal
    reach = counted.astype(np.int64)
    for a, b in reversed(node_levels(child_offsets)[1:]):  # deepest first: a node's count is
        up = parent[a:b]  # whole before it adds
        np.add.at(reach, up, np.where(terminal[up], 0, reach[a:b]))
    return reach


def _index_of(catalog: Catalog) -> _Index:
    with _lock:
        index = _indexes.get(catalog.trie)
        if index is None:
            index = _indexes[catalog.trie] = _Index(catalog)
        return index


def excluded_nodes(catalog: Catalog, item_ids: tuple, min_depth: int = 0) -> np.ndarray:
    """The sorted trie nodes closed by excluding `item_ids` (ids not in the catalog: ignored),
    counting only the paths that end at depth >= min_depth (min_new_tokens' closure)."""
    index = _index_of(catalog)
    rows = np.unique(index.rows_of(item_ids))  # an id sent twice (or as 7 and "7") counts once
    nodes, hits = np.unique(index.node_of_row[rows], return_counts=True)
    closed = nodes[hits == index.items_per_node[nodes]].tolist()
    out, lost = set(closed), {}
    reach = index.reach_from(min_depth)
    for node in closed:
        if index.depth[node] < min_depth:
            continue  # never counted: min_new_tokens closes it already
        ancestors = []
        p = int(index.parent[node])
        while p != 0:
            ancestors.append(p)
            p = int(index.parent[p])
        if any(index.items_per_node[a] for a in ancestors):
            continue  # an item on the way ends every beam first: this path is never reached
        for a in ancestors:
            lost[a] = lost.get(a, 0) + 1
            if lost[a] == reach[a]:
                out.add(a)
    return np.array(sorted(out), np.int64)


def unknown_ids(catalog: Catalog, item_ids: tuple) -> list:
    """The excluded ids, as sent and in order, that name no item of the catalog (the reply
    lists them: a history item the catalog no longer holds, or a typo)."""
    index = _index_of(catalog)
    if index.is_int:
        keys = [_as_int(x) for x in item_ids]
        valid = [k is not None for k in keys]
        query = np.array([k for k in keys if k is not None], np.int64)
    else:
        enc = [str(x).encode() for x in item_ids]
        valid = [len(e) <= index.width for e in enc]
        query = np.array([e for e, ok in zip(enc, valid, strict=True) if ok], f"S{index.width}")
    found = np.zeros(len(query), bool)
    if len(index.sorted) and len(query):
        at = np.minimum(np.searchsorted(index.sorted, query), len(index.sorted) - 1)
        found = index.sorted[at] == query
    hits = iter(found.tolist())
    return [x for x, ok in zip(item_ids, valid, strict=True) if not (ok and next(hits))]


def excluded_set(catalog: Catalog, item_ids: tuple) -> set:
    """The excluded ids as the catalog spells them (ints, or strings), to filter item_results."""
    index = _index_of(catalog)
    if index.is_int:
        return {k for k in map(_as_int, item_ids) if k is not None}
    return {str(x) for x in item_ids}
