"""PrefillCache: an opt-in LRU over exact prompts -> (context KV, last-token log-probabilities).

Only an exact prompt match is reused (a prefix would need its suffix prefilled against the cached
KV: not done). Every entry carries the weight version it was computed with; a lookup under another
version is a miss, so a stale entry is never used whatever flush said, and every weight write
drops all entries at once (`drop_entries`), so none holds KV memory after the update. Cached
tensors are shared by reference with running requests: context KV is never written after prefill.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from grctl.engine.kv_cache import ContextKV


@dataclass(frozen=True)
class Entry:
    version: str
    ctx: ContextKV
    logprobs: torch.Tensor  # [vocab] float32

    @property
    def num_tokens(self) -> int:
        return self.ctx.length

    @property
    def nbytes(self) -> int:
        return self.ctx.nbytes + self.logprobs.numel() * self.logprobs.element_size()


class PrefillCache:
    def __init__(self, enabled: bool, max_entries: int, max_tokens: int, max_bytes: int = 1 << 62):
        self.enabled = enabled
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes  # device memory its entries hold (KV of models differs 100x)
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.num_tokens = 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.hits = self.misses = self.inserts = self.evictions = 0

    def get(self, prompt: tuple[int, ...], version: str) -> Entry | None:
        if not self.enabled:
            return None
        with self._lock:
            entry = self._entries.get(prompt)
            if entry is not None and entry.version != version:
                self._drop(prompt)
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(prompt)
            self.hits += 1
            return entry

    def put(self, prompt: tuple[int, ...], entry: Entry) -> None:
        too_big = entry.num_tokens > self.max_tokens or entry.nbytes > self.max_bytes
        if not self.enabled or too_big or self.max_entries <= 0:
            return
        with self._lock:
            if prompt in self._entries:
                self._drop(prompt)
            self._entries[prompt] = entry
            self.num_tokens += entry.num_tokens
            self.num_bytes += entry.nbytes
            self.inserts += 1
            while (
                len(self._entries) > self.max_entries
                or self.num_tokens > self.max_tokens
                or self.num_bytes > self.max_bytes
            ):
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def _drop(self, prompt: tuple[int, ...]) -> None:
        entry = self._entries.pop(prompt)
        self.num_tokens -= entry.num_tokens
        self.num_bytes -= entry.nbytes

    def drop_entries(self) -> int:
        """Drop every entry, keeping the counters (the weights changed; nobody flushed)."""
        with self._lock:
            dropped = len(self._entries)
            self._entries.clear()
            self.num_tokens = self.num_bytes = 0
            return dropped

    def clear(self) -> int:
        """Drop every entry and reset the counters; returns the number of entries dropped."""
        with self._lock:
            cleared = len(self._entries)
            self._entries.clear()
            self.num_tokens = self.num_bytes = 0
            self._reset_counters()
            return cleared

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {
                "enabled": self.enabled,
                "entries": len(self._entries),
                "tokens": self.num_tokens,
                "bytes": self.num_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "inserts": self.inserts,
                "evictions": self.evictions,
                "max_entries": self.max_entries,
                "max_tokens": self.max_tokens,
                "max_bytes": self.max_bytes,
            }
