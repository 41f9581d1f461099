"""ResultStore: finished results kept until fetched, bounded (the oldest unfetched dropped).

A request that has ended but whose result is still being built (off the engine's lock, by the
worker: a beam search's top logprobs can take a while to read back) is pending: its id is taken,
and a wait for its result goes on until it is put (or forgotten, when building it failed)."""

from __future__ import annotations

from collections import OrderedDict

from grctl.engine.request import GenerateResult


class ResultStore:
    def __init__(self, max_results: int = 10_000):
        self.max_results = max_results
        self._results: OrderedDict[str, GenerateResult] = OrderedDict()
        self.num_evicted = 0
        self._pending: set[str] = set()

    def __contains__(self, request_id: str) -> bool:
        """Its id is taken: a result kept, or one being built."""
        return request_id in self._results or request_id in self._pending

    def __len__(self) -> int:
        return len(self._results)

    def is_ready(self, request_id: str) -> bool:
        return request_id in self._results

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def expect(self, request_id: str) -> None:
        """Its request has ended; its result is being built."""
        self._pending.add(request_id)

    def forget(self, request_id: str) -> None:
        """Building its result failed: no result will come."""
        self._pending.discard(request_id)

    def put(self, result: GenerateResult) -> None:
        self._pending.discard(result.request_id)
        self._results[result.request_id] = result
        while len(self._results) > self.max_results:
            self._results.popitem(last=False)
            self.num_evicted += 1

    def peek(self, request_id: str) -> GenerateResult | None:
        return self._results.get(request_id)

    def pop(self, request_id: str) -> GenerateResult | None:
        return self._results.pop(request_id, None)
