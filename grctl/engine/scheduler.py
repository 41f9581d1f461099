"""Scheduler: the waiting queue and the running set, and the policy that moves between them.

Policy only, no tensors. Each step admits waiting requests in arrival order while the running set
has room, their prompts fit the prefill token budget (the first always goes, so a prompt longer
than the budget still runs alone) and the KV they would hold fits the KV byte budget beside what
the running requests hold (with nothing running, the first goes: the engine refuses at submit a
request that could never fit), then every running request decodes one token per beam.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from grctl.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(
        self,
        max_running: int,
        prefill_token_budget: int,
        kv_bytes_budget: int | None = None,
        kv_bytes_of: Callable[[Sequence], int] = lambda seq: 0,
    ):
        self.max_running = max_running
        self.prefill_token_budget = prefill_token_budget
        self.kv_bytes_budget = kv_bytes_budget  # None: no limit
        self.kv_bytes_of = kv_bytes_of
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """-> (to prefill, already running): the admitted ones move to the running set."""
        decode = [s for s in self.running if not s.is_done]
        prefill: list[Sequence] = []
        budget = self.prefill_token_budget
        kv_free = None
        if self.kv_bytes_budget is not None:
            kv_free = self.kv_bytes_budget - self.kv_bytes_running()
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if prefill and seq.num_prompt_tokens > budget:
                break
            if kv_free is not None:
                need = self.kv_bytes_of(seq)
                if self.running and need > kv_free:
                    break
                kv_free -= need
            budget -= seq.num_prompt_tokens
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefill.append(seq)
        return prefill, decode

    def kv_bytes_running(self) -> int:
        return sum(self.kv_bytes_of(s) for s in self.running)

    def remove(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def retract_running(self) -> int:
        """Every running request drops its KV and goes back to the front of the queue, in order."""
        retracted = self.running
        self.running = []
        for seq in reversed(retracted):
            seq.retract()
            self.waiting.appendleft(seq)
        return len(retracted)

    def all_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]
