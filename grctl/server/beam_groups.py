"""BeamGroups: the server-side store of multi-stage groups that verl-GR reads one beam at a time
(docs/http-api.md "Beam groups").

verl-GR sends one call per (beam_group_id, beam_index). The first call of an id computes the
group; calls arriving meanwhile wait for it; every call then reads its beam of the same group.
An entry goes once `width` calls were served, after `ttl_s`, when the store is over `max_bytes`
(least recently used first; the entry being served stays), on clear() (an abort of all) or on
discard() (an abort of a call reading it). A call whose request differs from the group's (its
fingerprint) is a 409. All methods may block and
run in worker threads (server/offload.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from grctl.errors import Conflict, GenerateTimeout
from grctl.protocol.generate import GenerateResponse


@dataclass(eq=False)
class _Entry:
    fingerprint: str
    width: int
    created: float
    done: threading.Event = field(default_factory=threading.Event)
    reply: GenerateResponse | None = None
    error: BaseException | None = None
    nbytes: int = 0
    served: int = 0


class BeamGroups:
    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.num_bytes = 0
        self.computed = 0  # groups computed (a second call of a group computes nothing)

    def serve(
        self,
        group_id: str,
        fingerprint: str,
        width: int,
        compute: Callable[[], GenerateResponse],
        timeout: float | None = None,
    ) -> GenerateResponse:
        """The group's whole reply, computed by the first call of `group_id` only."""
        with self._lock:
            self._expire()
            entry = self._entries.get(group_id)
            if entry is not None and entry.fingerprint != fingerprint:
                raise Conflict(
                    f"beam_group_id {group_id!r} names a group of another request",
                    hint="every call of one group sends the same prompt and sampling_params "
                    "but beam_index; use a new beam_group_id for another request",
                )
            owner = entry is None
            if owner:
                entry = self._entries[group_id] = _Entry(fingerprint, width, self.clock())
            self._entries.move_to_end(group_id)
        if owner:
            self._compute(group_id, entry, compute)
        elif not entry.done.wait(timeout):
            raise GenerateTimeout(f"beam group {group_id!r} was not computed in time")
        if entry.error is not None:
            raise entry.error
        with self._lock:
            entry.served += 1
            if entry.served >= entry.width:
                self._drop(group_id, entry)
            self._evict(keep=group_id)
        assert entry.reply is not None
        return entry.reply

    def _compute(self, group_id: str, entry: _Entry, compute) -> None:
        try:
            entry.reply = compute()
            entry.nbytes = len(msgspec.json.encode(entry.reply))
            with self._lock:
                self.computed += 1
                if self._entries.get(group_id) is entry:
                    self.num_bytes += entry.nbytes
        except BaseException as exc:  # every waiter sees it; the next call computes anew
            entry.error = exc
            with self._lock:
                if self._entries.get(group_id) is entry:
                    del self._entries[group_id]
            raise
        finally:
            entry.done.set()

    def _drop(self, group_id: str, entry: _Entry) -> None:
        if self._entries.get(group_id) is entry:
            del self._entries[group_id]
            self.num_bytes -= entry.nbytes

    def _expire(self) -> None:
        now = self.clock()
        for gid, e in list(self._entries.items()):
            if e.done.is_set() and now - e.created > self.ttl_s:
                self._drop(gid, e)

    def _evict(self, keep: str) -> None:
        for gid, e in list(self._entries.items()):
            if self.num_bytes <= self.max_bytes:
                return
            if gid != keep and e.done.is_set():
                self._drop(gid, e)

    def clear(self) -> int:
        """Drop every computed group (an abort); groups being computed end as they do."""
        with self._lock:
            done = [(g, e) for g, e in self._entries.items() if e.done.is_set()]
            for gid, e in done:
                self._drop(gid, e)
            return len(done)

    def discard(self, group_id: str) -> bool:
        """Drop one group (an abort of a call reading it), computed or not: calls waiting for
        it get what its computation ends with, and the next call of the id computes anew."""
        with self._lock:
            entry = self._entries.get(group_id)
            if entry is None:
                return False
            if entry.done.is_set():
                self._drop(group_id, entry)
            else:
                del self._entries[group_id]
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
