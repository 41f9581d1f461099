"""PrefixCache: the KV of prompts prefilled before, in a radix tree over token ids, reused by
every later prompt that starts with the same tokens.

A node holds a run of tokens and their KV (per layer [num_kv_heads, run, head_dim], in storage of
its own, so the bytes it reports are the bytes it holds); a node where a prompt ended also holds
that prompt's last-token log-probabilities, so an exact repeat skips the model. A lookup returns
the longest cached prefix: all of the prompt on an exact repeat, else at most all but its last
token (whose logits must be computed). An insert splits a node where the new prompt leaves it and
adds the rest as a leaf.

Weight versions: the tree holds one tag (the weights' label and write generation); a lookup or an
insert under another tag drops every node first, so no entry of other weights is ever used, and
every weight write drops them all at once (`drop_entries`) with the bytes they held. Eviction
takes least recently used leaves first until prompts, tokens and bytes fit their bounds. Tensors
are shared by reference with running requests: context KV is never written after prefill. A
request continuing cached nodes holds them as its context's prefix chain (kv_cache.ContextKV),
so its prefill copies none of their KV, and decode reads a node once for every request of the
step that continues it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from grctl.engine.kv_cache import ContextKV

BLOCK = 16  # tokens per hash block when prompts of one batch are compared (`waits`)


def weights_tag(label: str, generation: int) -> str:
    """What cached KV is tagged with: the label and the write (a relabel-free update must not
    reuse KV of the old weights, nor a relabel claim it for the new label)."""
    return f"{label}#{generation}"


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _owns_storage(kv: ContextKV) -> bool:
    """Each tensor is the whole of its storage (not a view into a batch's buffer)."""
    return all(
        t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        for t in (*kv.k, *kv.v)
    )


def slice_kv(kv: ContextKV, start: int, end: int | None = None, copy: bool = False) -> ContextKV:
    """Tokens [start, end) of every layer; `copy`: in storage of their own."""

    def part(t: torch.Tensor) -> torch.Tensor:
        view = t[:, start:end]
        return view.clone(memory_format=torch.contiguous_format) if copy else view

    return ContextKV(tuple(part(t) for t in kv.k), tuple(part(t) for t in kv.v))


def join_kv(parts: Sequence[ContextKV]) -> ContextKV:
    """One ContextKV of consecutive parts' own tokens, copied (the only part itself, uncopied,
    when it continues nothing)."""
    if len(parts) == 1 and parts[0].prefix is None:
        return parts[0]
    layers = range(len(parts[0].k))
    return ContextKV(
        tuple(torch.cat([p.k[i] for p in parts], dim=1) for i in layers),
        tuple(torch.cat([p.v[i] for p in parts], dim=1) for i in layers),
    )


def _tokens_from(ctx: ContextKV, start: int) -> ContextKV:
    """The KV of tokens [start, end) of a context's chain, in storage of its own: the context's
    own tensors by reference when they are exactly those tokens, else a copy."""
    own_start = ctx.length - ctx.own_length
    own = ContextKV(ctx.k, ctx.v)
    if start == own_start and _owns_storage(own):
        return own
    if start > own_start:
        return slice_kv(own, start - own_start, copy=True)
    return slice_kv(join_kv(ctx.parts), start, copy=True)


class _Node:
    __slots__ = ("tokens", "kv", "logprobs", "children", "parent")

    def __init__(self, tokens: tuple[int, ...], kv: ContextKV | None, parent: _Node | None):
        self.tokens = tokens
        self.kv = kv
        self.logprobs: torch.Tensor | None = None  # [vocab] float32 where a prompt ended
        self.children: dict[int, _Node] = {}  # by first token
        self.parent = parent

    @property
    def nbytes(self) -> int:
        kv = _nbytes((*self.kv.k, *self.kv.v)) if self.kv is not None else 0
        return kv + (_nbytes((self.logprobs,)) if self.logprobs is not None else 0)


@dataclass
class Match:
    """A lookup's answer: the first `num_tokens` of the prompt are cached."""

    num_tokens: int = 0
    parts: list[ContextKV] = field(default_factory=list)  # their KV, node by node
    logprobs: torch.Tensor | None = None  # an exact repeat: its last token's log-probabilities


def _common(run: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """How many leading tokens of `run` equal tokens[start:]."""
    if tokens[start : start + len(run)] == run:
        return len(run)
    n = 0
    for a, b in zip(run, tokens[start:]):  # noqa: B905 (the shorter one bounds it)
        if a != b:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, enabled: bool, max_entries: int, max_tokens: int, max_bytes: int = 1 << 62):
        self.enabled = enabled
        self.max_entries = max_entries  # prompts whose end is cached
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes  # memory its KV and log-probabilities hold on the device
        self.tag: str | None = None
        self._lock = threading.Lock()
        self._reset_tree()
        self._reset_counters()

    def _reset_tree(self) -> None:
        self._root = _Node((), None, None)
        # Every node, least recently used first. A path is touched leaf first, so a node always
        # comes before its ancestors and the first node is a leaf.
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self.num_entries = self.num_tokens = self.num_bytes = 0

    def _reset_counters(self) -> None:
        self.hits = self.misses = self.inserts = self.evictions = self.hit_tokens = 0

    # ---- lookups ------------------------------------------------------------------------
    def lookup(self, prompt: tuple[int, ...], tag: str, limit: int | None = None) -> Match:
        """The longest cached prefix of `prompt` under `tag` (at most `limit` tokens: a prompt
        scored from there on computes the rest), counted as a hit or a miss."""
        if not self.enabled:
            return Match()
        with self._lock:
            self._adopt(tag)
            path = self._walk(prompt)
            match = self._match(prompt, path, limit=limit)
            self._touch([node for node, _ in path])
            if match.num_tokens:
                self.hits += 1
                self.hit_tokens += match.num_tokens
            else:
                self.misses += 1
            return match

    def peek(self, prompt: tuple[int, ...], tag: str, limit: int | None = None) -> int:
        """How many tokens of `prompt` a lookup would find now; counts and touches nothing."""
        if not self.enabled:
            return 0
        with self._lock:
            if tag != self.tag:
                return 0
            return self._match(prompt, self._walk(prompt), False, limit).num_tokens

    def waits(self, prompts: Sequence[tuple[int, ...]], tag: str) -> list[bool]:
        """For a batch prefilled together: True for each prompt that shares at least a block
        more with an earlier prompt of the batch than the cache holds, so it is better
        prefilled after them, against their KV."""
        if not self.enabled:
            return [False] * len(prompts)
        seen: set[int] = set()
        out = []
        for prompt in prompts:
            chain, shared = 0, 0
            for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
                chain = hash((chain, prompt[start : start + BLOCK]))
                if chain not in seen:
                    seen.add(chain)
                elif shared == start:
                    shared = start + BLOCK
            out.append(shared >= self.peek(prompt, tag) + BLOCK)
        return out

    def _walk(self, prompt: tuple[int, ...]) -> list[tuple[_Node, int]]:
        """The nodes along `prompt`, each with how many of its tokens match."""
        node, i, path = self._root, 0, []
        while i < len(prompt):
            child = node.children.get(prompt[i])
            if child is None:
                break
            n = _common(child.tokens, prompt, i)
            path.append((child, n))
            i += n
            if n < len(child.tokens):
                break
            node = child
        return path

    def _match(
        self, prompt: tuple[int, ...], path, with_kv: bool = True, limit: int | None = None
    ) -> Match:
        total = sum(n for _, n in path)
        if total == len(prompt) and path and limit is None:
            last, n = path[-1]
            if n == len(last.tokens) and last.logprobs is not None:
                parts = [node.kv for node, _ in path] if with_kv else []
                return Match(total, parts, last.logprobs)
        left, parts = min(total, len(prompt) - 1), []  # the last token is computed
        if limit is not None:
            left = min(left, limit)
        total = left
        for node, n in path:
            if left <= 0:
                break
            take = min(n, left)
            if with_kv:
                parts.append(node.kv if take == len(node.tokens) else slice_kv(node.kv, 0, take))
            left -= take
        return Match(total, parts)

    # ---- inserts ------------------------------------------------------------------------
    def insert(
        self, prompt: tuple[int, ...], ctx: ContextKV, logprobs: torch.Tensor | None, tag: str
    ) -> None:
        """Keep a prefilled prompt: ctx holds the KV of all of its tokens, logprobs [vocab]
        its last token's log-probabilities (copied: a row of a batch would hold the batch);
        None: KV only, no exact-repeat entry (engine/output_kv.py)."""
        too_big = len(prompt) > self.max_tokens or ctx.nbytes > self.max_bytes
        if not self.enabled or too_big or not prompt:
            return
        with self._lock:
            self._adopt(tag)
            path = self._walk(prompt)
            if path and path[-1][1] < len(path[-1][0].tokens):
                path[-1] = (self._split(*path[-1]), path[-1][1])
            node = path[-1][0] if path else self._root
            done = sum(n for _, n in path)
            if done < len(prompt):
                kv = _tokens_from(ctx, done)
                leaf = _Node(prompt[done:], kv, node)
                node.children[prompt[done]] = leaf
                self.num_tokens += len(leaf.tokens)
                self.num_bytes += leaf.nbytes
                path.append((leaf, len(leaf.tokens)))
                node = leaf
            if node.logprobs is None and logprobs is not None:
                node.logprobs = logprobs.detach().clone()
                self.num_bytes += _nbytes((node.logprobs,))
                self.num_entries += 1
                self.inserts += 1
            self._touch([n for n, _ in path])
            self._evict()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens; returns the new upper node. Both halves are copied
        into storage of their own, so evicting one frees its bytes."""
        upper = _Node(node.tokens[:at], slice_kv(node.kv, 0, at, copy=True), node.parent)
        before = node.nbytes
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.kv, node.parent = (
            node.tokens[at:],
            slice_kv(node.kv, at, copy=True),
            upper,
        )
        upper.children[node.tokens[0]] = node
        self.num_bytes += upper.nbytes + node.nbytes - before
        self._lru[upper] = None
        return upper

    # ---- eviction and drops -------------------------------------------------------------
    def _touch(self, nodes: list[_Node]) -> None:
        for node in reversed(nodes):  # leaf first: each node ends up before its ancestors
            self._lru[node] = None
            self._lru.move_to_end(node)

    def _evict(self) -> None:
        while self._lru and (
            self.num_entries > self.max_entries
            or self.num_tokens > self.max_tokens
            or self.num_bytes > self.max_bytes
        ):
            leaf = next(iter(self._lru))
            assert not leaf.children
            self._remove(leaf)
            self.evictions += 1

    def _remove(self, leaf: _Node) -> None:
        del self._lru[leaf]
        del leaf.parent.children[leaf.tokens[0]]
        self.num_tokens -= len(leaf.tokens)
        self.num_bytes -= leaf.nbytes
        self.num_entries -= leaf.logprobs is not None

    def _adopt(self, tag: str) -> None:
        if tag != self.tag:
            self._reset_tree()
            self.tag = tag

    def drop_entries(self) -> int:
        """Drop every entry and the bytes it held, keeping the counters (the weights changed;
        nobody flushed). Returns the number of prompts dropped."""
        with self._lock:
            dropped = self.num_entries
            self._reset_tree()
            return dropped

    def clear(self) -> int:
        """Drop every entry and reset the counters; returns the number of prompts dropped."""
        with self._lock:
            cleared = self.num_entries
            self._reset_tree()
            self._reset_counters()
            return cleared

    def __len__(self) -> int:
        return self.num_entries

    def held_bytes(self) -> int:
        """The bytes of the distinct storages the nodes hold (what `bytes` must equal)."""
        with self._lock:
            storages = {}
            for node in self._lru:
                for t in (*node.kv.k, *node.kv.v, node.logprobs):
                    if t is not None:
                        s = t.untyped_storage()
                        storages[s.data_ptr()] = s.nbytes()
            return sum(storages.values())

    def stats(self) -> dict:
        with self._lock:
            return {
                "enabled": self.enabled,
                "entries": self.num_entries,
                "nodes": len(self._lru),
                "tokens": self.num_tokens,
                "bytes": self.num_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "hit_tokens": self.hit_tokens,
                "inserts": self.inserts,
                "evictions": self.evictions,
                "max_entries": self.max_entries,
                "max_tokens": self.max_tokens,
                "max_bytes": self.max_bytes,
            }
