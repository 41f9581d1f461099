"""min_new_tokens under a catalog: the trie nodes a beam may not enter while its item would end
too soon.

A beam stops at the first item it completes, so a node leads only to the items on its subtree
that no shorter item shadows. Before min_new_tokens, a node is open only if one of those ends
deep enough: a prefix whose every item is too short is closed as a whole (as exclusions.py
closes a prefix whose every item is excluded), not only the child that would complete an item,
so no beam enters a prefix it can never finish and the behaviour policy, renormalised over the
open children, is a distribution over the items allowed. Per node, the depth of the deepest
item a beam entering it can complete (-1: none) is built once per trie with array ops, on the
first request that needs it, and kept on the trie's device.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from grctl.catalog.trie import Trie

_deepest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Trie -> (host, device)
_lock = threading.Lock()


def node_levels(child_offsets: np.ndarray) -> list[tuple[int, int]]:
    """The node range [a, b) of each depth (nodes are numbered by depth: each is contiguous)."""
    levels = [(0, 1)]
    while True:
        a, b = levels[-1]
        na, nb = int(child_offsets[a]) + 1, int(child_offsets[b]) + 1
        if na >= nb:
            return levels
        levels.append((na, nb))


def parents_of(child_offsets: np.ndarray) -> np.ndarray:
    """Each node's parent (the root's: 0)."""
    num_nodes = child_offsets.size - 1
    parent = np.zeros(num_nodes, np.int64)
    parent[1:] = np.repeat(np.arange(num_nodes), np.diff(child_offsets))
    return parent


def node_depths(child_offsets: np.ndarray) -> np.ndarray:
    depth = np.zeros(child_offsets.size - 1, np.int64)
    for d, (a, b) in enumerate(node_levels(child_offsets)):
        depth[a:b] = d
    return depth


def _build(trie: Trie) -> tuple[np.ndarray, torch.Tensor]:
    offsets = trie.child_offsets.cpu().numpy().astype(np.int64)
    terminal = np.diff(trie.item_offsets) > 0
    parent = parents_of(offsets)
    deep = np.where(terminal, node_depths(offsets), -1)
    for a, b in reversed(node_levels(offsets)[1:]):  # deepest first: a level is whole before
        up = parent[a:b]
        np.maximum.at(deep, up, np.where(terminal[up], -1, deep[a:b]))  # an item ends its beam
    return deep, torch.from_numpy(deep.astype(np.int32)).to(trie.device)


def _of(trie: Trie) -> tuple[np.ndarray, torch.Tensor]:
    with _lock:
        built = _deepest.get(trie)
        if built is None:
            built = _deepest[trie] = _build(trie)
        return built


def deepest(trie: Trie) -> torch.Tensor:
    """Per node [nodes], on the trie's device: the depth of the deepest item a beam entering it
    can complete (-1: none). A request whose item must end at depth >= t (t = the depth it
    starts at + min_new_tokens) may enter a node only where this is >= t."""
    return _of(trie)[1]


def deepest_host(trie: Trie) -> np.ndarray:
    """deepest(trie) on the host."""
    return _of(trie)[0]


def is_reachable(trie: Trie, node: int, min_depth: int) -> bool:
    """Some item a beam at `node` can complete ends at depth >= min_depth."""
    return bool(_of(trie)[0][node] >= min_depth)
