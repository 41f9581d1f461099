"""Where a request's item starts in the catalog's trie: at the root, or inside a partial item
its prompt ends with.

A trainer resumes an aborted sample (slime's and miles' partial rollout) by sending the prompt
followed by the tokens generated so far. When the abort came in the middle of an item, the
prompt ends with a proper prefix of an item path, and the search must complete that item rather
than start a new one after it. Two ways decide where the item starts:

- The catalog's own rule, nothing to send: in a self-delimiting catalog (no token that begins
  an item path appears further along any path; semantic IDs whose levels have their own token
  ranges are) every occurrence of a begin token starts an item. The tail of the prompt from its
  last begin token resumes when it walks the trie to a node that is no item's end: a proper
  prefix of an item path. Anything else (the tail is a whole item, or leaves the trie, or no
  begin token is among the last max_depth - 1 tokens) starts at the root. In a catalog that is
  not self-delimiting this rule is off: a prompt ending in a whole item could also read as the
  start of another, so the search starts at the root unless the request pins it.
- `item_prefix_len` k (sampling_params) pins it: the prompt's last k tokens begin the item
  (0: start at the root). They must be a proper prefix of an item path, else the request is
  refused, naming them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from grctl.errors import ValidationError

if TYPE_CHECKING:
    from grctl.catalog.trie import Trie


@dataclass(frozen=True)
class ItemStart:
    node: int = 0  # the trie node every beam starts from (0: the root)
    depth: int = 0  # the prompt's tokens already on that path


ROOT = ItemStart()


def _partial(trie: Trie, tail: list[int]) -> int | None:
    """The node `tail` walks to when it is a proper prefix of an item path, else None."""
    node = trie.walk(tail)
    if node is None or node == 0 or trie.is_item_end(node):
        return None
    return node


def item_start(trie: Trie, prompt: tuple[int, ...] | list[int], pinned: int | None) -> ItemStart:
    """Where the search of `prompt` starts (the rules above); pinned: item_prefix_len."""
    if pinned is not None:
        return _pinned(trie, list(prompt), pinned)
    if not trie.stats.self_delimiting:
        return ROOT
    window = list(prompt[-(trie.depth - 1) :]) if trie.depth > 1 else []
    if not window:
        return ROOT
    is_begin = np.isin(np.asarray(window), trie.begin_tokens)
    if not is_begin.any():
        return ROOT
    start = int(np.flatnonzero(is_begin)[-1])
    node = _partial(trie, window[start:])
    return ROOT if node is None else ItemStart(node, len(window) - start)


def _pinned(trie: Trie, prompt: list[int], k: int) -> ItemStart:
    if k == 0:
        return ROOT
    if k > len(prompt):
        raise ValidationError(
            f"item_prefix_len {k} is longer than the prompt ({len(prompt)} tokens)",
            hint="send the number of the prompt's last tokens that begin the item",
        )
    tail = prompt[-k:]
    node = _partial(trie, tail) if k < trie.depth else None
    if node is None:
        shown = tail if k <= 8 else [*tail[:8], "..."]
        raise ValidationError(
            f"item_prefix_len {k}: the prompt's last {k} tokens {shown} are not the start of an "
            "item path of the served catalog (a whole item, or no item's prefix)",
            hint="send the tokens generated so far of an unfinished item, or item_prefix_len 0 "
            "to start a new item",
        )
    return ItemStart(node, k)
