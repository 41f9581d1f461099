"""The catalog's token trie, built with array ops (no Python object per item or node).

Nodes are numbered breadth first: the root is 0, then every depth-1 node in token order, then
every depth-2 node, and so on, so the children of one node are consecutive and edge e leads to
node e + 1. Per node, CSR arrays:
  child_offsets [nodes + 1]  node p's children are edges child_offsets[p] : child_offsets[p + 1]
  child_tokens  [nodes - 1]  the token of each edge, ascending within a node
  item_offsets  [nodes + 1]  node p's items are item_index[item_offsets[p] : item_offsets[p + 1]]
  item_index    [items]      row numbers in the file, so several items may share one path
child_offsets, child_tokens and is_terminal also live on the engine's device as tensors (the
decode step gathers from them); the item arrays stay on the host, read once per finished request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TrieStats:
    num_items: int
    num_paths: int  # distinct paths (terminal nodes)
    num_nodes: int
    max_depth: int
    depth_histogram: dict[int, int]  # path length -> items
    num_collision_paths: int  # paths shared by several items
    num_collision_items: int  # items on those paths
    num_shadowed_items: int  # items whose path extends another item's path: never reached
    # no token that begins an item path appears further along any path: a prompt's partial
    # item is found without being told (catalog/resume.py)
    self_delimiting: bool = False


class Trie:
    def __init__(self, paths: np.ndarray, lengths: np.ndarray, device: torch.device):
        """paths [items, depth] int32, -1 past each path's end; lengths [items] (all >= 1)."""
        num_items, depth = paths.shape
        order = _lexicographic_order(paths)  # a path sorts before its extensions
        sorted_paths, sorted_lens = paths[order], lengths[order]
        differs = np.zeros(num_items, bool)
        differs[0] = True
        parent_of_row = np.zeros(num_items, np.int64)  # each sorted row's node at depth d - 1
        terminal = np.zeros(num_items, np.int64)
        parents, tokens, depth_starts = [], [], [1]
        through: list[tuple[int, np.ndarray]] = []
        num_nodes = 1
        for d in range(depth):
            col = sorted_paths[:, d]
            differs[1:] |= col[1:] != col[:-1]
            has = sorted_lens > d
            is_new = differs & has
            node = num_nodes - 1 + np.cumsum(is_new)  # valid where `has`
            first = np.flatnonzero(is_new)
            parents.append(parent_of_row[first])
            tokens.append(col[first])
            ends = sorted_lens == d + 1
            terminal[ends] = node[ends]
            parent_of_row = np.where(has, node, 0)
            num_nodes += first.size
            depth_starts.append(num_nodes)
            if d + 1 < depth:
                through.append((d, node))  # to find longer paths through an item's node
        parent = np.concatenate(parents)  # [nodes - 1], non-decreasing: edge e -> node e + 1
        child_offsets = _csr_offsets(parent, num_nodes)
        child_tokens = np.concatenate(tokens).astype(np.int32)
        terminal_unsorted = np.empty(num_items, np.int64)
        terminal_unsorted[order] = terminal
        item_index = np.argsort(terminal_unsorted, kind="stable").astype(np.int32)
        item_offsets = _csr_offsets(terminal_unsorted, num_nodes)
        items_per_node = np.diff(item_offsets)
        # items whose path runs on through a node where another item ends: never reached
        shadowed = np.zeros(num_items, bool)
        for d, node in through:
            shadowed |= (sorted_lens > d + 1) & (items_per_node[node] > 0)
        children_per_node = np.diff(child_offsets)
        # widest fan-out at each depth: the decode step's gather width, known without a sync
        ranges = [(0, 1)] + [(depth_starts[k - 1], depth_starts[k]) for k in range(1, depth)]
        self.max_children = [int(children_per_node[a:b].max(initial=0)) for a, b in ranges]
        self.depth = depth
        self.num_nodes = num_nodes
        self.item_offsets = item_offsets
        self.item_index = item_index
        # the tokens that begin an item (the root's children, ascending), and whether any of
        # them also appears past a path's first position
        self.begin_tokens = child_tokens[child_offsets[0] : child_offsets[1]].copy()
        deeper = child_tokens[child_offsets[1] :]
        self_delimiting = not bool(np.isin(self.begin_tokens, deeper).any())
        collided = items_per_node > 1
        hist = np.bincount(lengths, minlength=depth + 1)
        self.stats = TrieStats(
            num_items=num_items,
            num_paths=int((items_per_node > 0).sum()),
            num_nodes=num_nodes,
            max_depth=depth,
            depth_histogram={d: int(c) for d, c in enumerate(hist) if c},
            num_collision_paths=int(collided.sum()),
            num_collision_items=int(items_per_node[collided].sum()),
            num_shadowed_items=int(shadowed.sum()),
            self_delimiting=self_delimiting,
        )
        self.device = device
        to_dev = (lambda a: torch.from_numpy(a).to(device)) if device.type != "cpu" else None
        host = torch.from_numpy
        self.child_offsets = (to_dev or host)(child_offsets)
        self.child_tokens = (to_dev or host)(child_tokens)
        self.is_terminal = (to_dev or host)(items_per_node > 0)

    @property
    def nbytes(self) -> int:
        """Bytes the trie holds (device tensors and host item arrays)."""
        tensors = (self.child_offsets, self.child_tokens, self.is_terminal)
        return sum(t.numel() * t.element_size() for t in tensors) + int(
            self.item_offsets.nbytes + self.item_index.nbytes + self.begin_tokens.nbytes
        )

    def width(self, depth: int) -> int:
        """The widest fan-out of a node at `depth` (0: the root): a gather's width, no sync."""
        return max(self.max_children[depth] if depth < self.depth else 0, 1)

    def children(
        self, nodes: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """nodes [rows] -> each node's first `width` children: tokens and child nodes
        [rows, width] int64, and valid [rows, width] (False past a node's last child)."""
        start = self.child_offsets[nodes].long()
        end = self.child_offsets[nodes + 1].long()
        edge = start[:, None] + torch.arange(width, device=nodes.device)
        valid = edge < end[:, None]
        edge = edge.clamp(max=max(self.child_tokens.numel() - 1, 0))
        return self.child_tokens[edge].long(), edge + 1, valid

    def items_of(self, node: int) -> np.ndarray:
        """Row numbers of the items whose path ends at `node`."""
        return self.item_index[self.item_offsets[node] : self.item_offsets[node + 1]]

    def is_item_end(self, node: int) -> bool:
        """Some item's path ends at `node` (a beam reaching it stops there)."""
        return bool(self.item_offsets[node + 1] > self.item_offsets[node])

    def walk(self, tokens: list[int]) -> int | None:
        """The node a token path leads to from the root, or None if it leaves the trie."""
        node = 0
        for t in tokens:
            lo, hi = int(self.child_offsets[node]), int(self.child_offsets[node + 1])
            kids = self.child_tokens[lo:hi].cpu().numpy()
            i = int(np.searchsorted(kids, t))
            if i >= kids.size or kids[i] != t:
                return None
            node = lo + i + 1
        return node


def _lexicographic_order(paths: np.ndarray) -> np.ndarray:
    """Row order sorting paths [items, depth] (-1 padded) lexicographically. One argsort of a
    packed int64 key when the columns fit in 63 bits (3 levels of 2**20 codes do), which is
    three times faster than lexsort over the columns."""
    depth = paths.shape[1]
    bits = int(paths.max(initial=0) + 2).bit_length()  # values -1 .. max as 0 .. max + 1
    if depth * bits > 63:
        return np.lexsort(paths.T[::-1])
    key = np.zeros(paths.shape[0], np.int64)
    for d in range(depth):
        key = (key << bits) | (paths[:, d].astype(np.int64) + 1)
    return np.argsort(key, kind="stable")


def _csr_offsets(owner: np.ndarray, num_nodes: int) -> np.ndarray:
    """owner [entries] (the node each entry belongs to) -> offsets [num_nodes + 1] int32."""
    offsets = np.zeros(num_nodes + 1, np.int64)
    np.cumsum(np.bincount(owner, minlength=num_nodes), out=offsets[1:])
    return offsets.astype(np.int32)
