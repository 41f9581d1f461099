"""Scheduler: the waiting queue and the running set (indexed by request id), and the policy that
moves requests between them.

Policy only, no tensors. Each step admits waiting requests in arrival order while the running set
has room, the prompt tokens they compute (those not in the prefix cache) fit the prefill token
budget (the first always goes, so a prompt longer than the budget still runs alone) and the KV
they would hold fits the KV byte budget beside what the running requests hold (with nothing
running, the first goes: the engine refuses at submit a request that could never fit), then
every running request decodes one token per beam.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from grctl.engine.request import GenerateRequest
from grctl.engine.sequence import Sequence, Status
from grctl.errors import ValidationError


class Scheduler:
    def __init__(
        self,
        max_running: int,
        prefill_token_budget: int,
        kv_bytes_budget: int | None = None,
        kv_bytes_of: Callable[[GenerateRequest], int] = lambda req: 0,
        prefill_tokens_of: Callable[[Sequence], int] = lambda seq: seq.num_prompt_tokens,
    ):
        self.max_running = max_running
        self.prefill_token_budget = prefill_token_budget
        self.kv_bytes_budget = kv_bytes_budget  # None: no limit
        self.kv_bytes_of = kv_bytes_of
        self.prefill_tokens_of = prefill_tokens_of  # the prompt tokens not in the prefix cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}  # every sequence waiting or running

    @property
    def num_in_flight(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def check_fits(self, req: GenerateRequest) -> None:
        """A request whose KV alone exceeds the budget could never be admitted: refuse it now."""
        if self.kv_bytes_budget is None:
            return
        need = self.kv_bytes_of(req)
        if need > self.kv_bytes_budget:
            raise ValidationError(
                f"the request needs {need} bytes of KV ({len(req.input_ids)} prompt tokens, "
                f"{req.sampling.width} beams), more than the server's KV budget of "
                f"{self.kv_bytes_budget}",
                hint="shorten the prompt or the beam width, or start the server with a larger "
                "--max-kv-bytes",
            )

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
            cost = self.prefill_tokens_of(seq)
            if prefill and cost > budget:
                break
            if kv_free is not None:
                need = 0 if seq.holds_kv else self.kv_bytes_of(seq.req)  # retracted, kept
                if self.running and need > kv_free:
                    break
                kv_free -= need
            budget -= cost
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefill.append(seq)
        return prefill, decode

    def kv_bytes_running(self) -> int:
        """The KV admitted: the running requests', and the retracted ones' that keep theirs."""
        return sum(self.kv_bytes_of(s.req) for s in self.holding_kv())

    def holding_kv(self) -> list[Sequence]:
        return [*self.running, *(s for s in self.waiting if s.holds_kv)]

    def remove(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        del self._by_id[seq.request_id]
        seq.status = Status.FINISHED

    def retract_running(self) -> int:
        """Every running request goes back to the front of the queue, in order, keeping its
        tokens and KV (Sequence.retract)."""
        retracted = self.running
        self.running = []
        for seq in reversed(retracted):
            seq.retract()
            self.waiting.appendleft(seq)
        return len(retracted)

    def drop_stale_kv(self) -> int:
        """The weights were written: retracted requests drop the KV of the old ones (they are
        recomputed when admitted again). -> how many did."""
        return sum(seq.drop_stale_kv() for seq in self.waiting)

    def all_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def stats(self) -> dict:
        """/status "scheduler": what the queues hold."""
        # The worker drops a finished request's KV without the lock (Executor._decode): read
        # each reference once, so a release between a check and the read is no AttributeError.
        kv = [(s.ctx, s.beam_kv) for s in self.holding_kv()]
        parts = {p.storage_key: p for c, _ in kv if c is not None for p in c.parts}
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "running_beams": sum(s.num_beams for s in self.running),
            "retracted_holding_kv": sum(s.holds_kv for s in self.waiting),
            "kv_bytes_budget": self.kv_bytes_budget,  # null: no limit
            "kv_bytes_admitted": self.kv_bytes_running(),
            # the context KV once per request (a prefix shared by several once), the decoded
            # tail once per beam
            "context_kv_bytes": sum(p.own_nbytes for p in parts.values()),
            "beam_kv_bytes": sum(b.nbytes for _, b in kv if b is not None),
        }
