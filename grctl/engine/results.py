"""ResultStore: finished results kept until fetched, bounded by count and by bytes.

The policy: a finished result is always stored (its own waiter, a /generate, may be about to
take it); then the oldest unfetched results are dropped until the store holds at most
`max_results` results and `max_bytes` bytes by `result_nbytes` (the newest one is never dropped
for its own size: a single result is bounded by the request's own limits). A dropped result's
id is remembered (the last EVICTED_IDS of them), so a fetch of it is a 404 that says why instead
of "no request".

A request that has ended but whose result is still being built (off the engine's lock, by the
worker: a beam search's top logprobs can take a while to read back) is pending: its id is taken,
and a wait for its result goes on until it is put (or forgotten, when building it failed)."""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import fields, is_dataclass

from grctl.engine.request import GenerateResult

EVICTED_IDS = 10_000

# What CPython holds per object (64-bit), as its allocator hands it out (16-byte classes): a
# float, an int past the small-int cache, a list (its header, then its slots apart), a tuple
# (header and slots together), a dataclass instance with its __dict__.
SLOT, FLOAT, INT, LIST, TUPLE, OBJECT = 8, 32, 32, 64, 40, 400


def _alloc(n: int) -> int:
    return (n + 15) // 16 * 16


def result_nbytes(obj) -> int:
    """The memory a result holds, as CPython lays it out: what --max-finished-result-bytes
    counts. Lists of scalars (or of (value, id) pairs) are sized from their first element; other
    containers are walked. Measured against RSS in tests/engine/test_result_store.py."""
    if obj is None or isinstance(obj, bool):
        return 0
    if isinstance(obj, float):
        return FLOAT
    if isinstance(obj, int):
        return INT
    if isinstance(obj, (str, bytes)):
        return sys.getsizeof(obj)
    if isinstance(obj, (list, tuple)):
        if isinstance(obj, list):
            head = LIST + _alloc(SLOT * len(obj))
        else:
            head = _alloc(TUPLE + SLOT * len(obj))
        if not obj:
            return head
        first = obj[0]
        if isinstance(first, (int, float)) and isinstance(obj[-1], (int, float)):
            return head + len(obj) * result_nbytes(first)
        if (
            isinstance(first, tuple)
            and all(isinstance(v, (int, float)) for v in first)
            and isinstance(obj[-1], tuple)
        ):
            return head + len(obj) * result_nbytes(first)
        return head + sum(result_nbytes(v) for v in obj)
    if isinstance(obj, dict):
        return sys.getsizeof(obj) + sum(result_nbytes(k) + result_nbytes(v) for k, v in obj.items())
    if is_dataclass(obj):
        return OBJECT + sum(result_nbytes(getattr(obj, f.name)) for f in fields(obj))
    nbytes = getattr(obj, "nbytes", None)  # an array
    return int(nbytes) if isinstance(nbytes, int) else sys.getsizeof(obj)


class ResultStore:
    def __init__(self, max_results: int = 10_000, max_bytes: int | None = None):
        self.max_results = max_results
        self.max_bytes = max_bytes  # None: no byte bound
        self._results: OrderedDict[str, tuple[GenerateResult, int]] = OrderedDict()
        self.num_evicted = 0
        self.nbytes = 0  # of the results kept, by result_nbytes
        self._pending: set[str] = set()
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        """Its id is taken: a result kept, or one being built."""
        return request_id in self._results or request_id in self._pending

    def __len__(self) -> int:
        return len(self._results)

    def is_ready(self, request_id: str) -> bool:
        return request_id in self._results

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def was_evicted(self, request_id: str) -> bool:
        """Its result was dropped unfetched (one of the last EVICTED_IDS dropped)."""
        return request_id in self._evicted

    def expect(self, request_id: str) -> None:
        """Its request has ended; its result is being built."""
        self._pending.add(request_id)

    def forget(self, request_id: str) -> None:
        """Building its result failed: no result will come."""
        self._pending.discard(request_id)

    def put(self, result: GenerateResult, nbytes: int | None = None) -> None:
        """Keep it (nbytes: its result_nbytes, when the caller measured it off the lock), then
        drop the oldest others while over either bound."""
        self._pending.discard(result.request_id)
        self._evicted.pop(result.request_id, None)
        size = result_nbytes(result) if nbytes is None else nbytes
        old = self._results.pop(result.request_id, None)
        if old is not None:
            self.nbytes -= old[1]
        self._results[result.request_id] = (result, size)
        self.nbytes += size
        while len(self._results) > 1 and (
            len(self._results) > self.max_results
            or (self.max_bytes is not None and self.nbytes > self.max_bytes)
        ):
            rid, (_, dropped) = self._results.popitem(last=False)
            self.nbytes -= dropped
            self.num_evicted += 1
            self._evicted[rid] = None
            while len(self._evicted) > EVICTED_IDS:
                self._evicted.popitem(last=False)

    def peek(self, request_id: str) -> GenerateResult | None:
        kept = self._results.get(request_id)
        return None if kept is None else kept[0]

    def pop(self, request_id: str) -> GenerateResult | None:
        kept = self._results.pop(request_id, None)
        if kept is None:
            return None
        self.nbytes -= kept[1]
        return kept[0]
