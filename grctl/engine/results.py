"""ResultStore: finished results kept until fetched, bounded (the oldest unfetched dropped)."""

from __future__ import annotations

from collections import OrderedDict

from grctl.engine.request import GenerateResult


class ResultStore:
    def __init__(self, max_results: int = 10_000):
        self.max_results = max_results
        self._results: OrderedDict[str, GenerateResult] = OrderedDict()
        self.num_evicted = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._results

    def __len__(self) -> int:
        return len(self._results)

    def put(self, result: GenerateResult) -> None:
        self._results[result.request_id] = result
        while len(self._results) > self.max_results:
            self._results.popitem(last=False)
            self.num_evicted += 1

    def peek(self, request_id: str) -> GenerateResult | None:
        return self._results.get(request_id)

    def pop(self, request_id: str) -> GenerateResult | None:
        return self._results.pop(request_id, None)
