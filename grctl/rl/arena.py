"""A trainer's weights pushed in place: its parameters live in one shared-memory segment laid out
as a push's buckets, so a sync sends views of them and copies nothing on the client.

    arena = Arena.adopt(model)          # once: every parameter moves into shared memory
    with WeightSync(url) as sync:
        for step in range(steps):
            train_step(model)           # the optimizer writes the arena's views in place
            sync.run(arena, weight_version=step)

The segment holds each tensor at the offset a flattened bucket gives it (buckets of at most
`bucket_mb`, by default one bucket for the whole model: one update call), in the trainer's own
dtypes: a float32 trainer pushing to a bfloat16 server sends float32, and the server's copy
casts (nothing is cast or copied here). The server reads the segment during each call, so the
trainer must not step while a sync runs (WeightSync.run returns after the last reply). For a
CPU server on this host; a CUDA server gets ordinary staged buckets from the same object.

Names are the model's state-dict names (HF names for transformers' Qwen3); tied weights are
pushed once. The arena is a source WeightSync and GRClient.push_tensors take as they take a
state dict (specs, fetch); its `plans` and `bucket_view` let the push skip staging.
"""

from __future__ import annotations

import atexit
import math
import weakref

import torch

from grctl.client import buffers, sources, staging
from grctl.errors import ValidationError

PAGE = 4096  # each bucket starts on its own page


class Arena:
    """Tensors placed in one shared-memory segment, bucket by bucket (see the module doc)."""

    config = None  # no checkpoint structure: the push plans against the served model

    def __init__(self, named_tensors, bucket_mb: float | None = None):
        """Copy `named_tensors` ((name, tensor) pairs or a state dict; CPU, dense) into a new
        segment; `tensors()` gives the views that now hold them."""
        given = sources.NamedTensors(named_tensors)
        self._specs = given.specs()
        for spec in self._specs:
            if given.fetch(spec.name).device.type != "cpu":
                raise ValidationError(
                    f"tensor {spec.name!r} is not on the CPU: an arena is host memory"
                )
        total = sum(math.prod(s.shape) * s.dtype.itemsize for s in self._specs)
        budget = int(bucket_mb * staging.MiB) if bucket_mb else max(total, 1)
        self._plans = staging.plan_buckets(self._specs, None, budget)
        self._bases, offset = [], 0
        for plan in self._plans:
            self._bases.append(offset)
            offset += -(-plan.nbytes // PAGE) * PAGE
        self.nbytes = offset
        self.flat = buffers.shared_buffer(max(offset, 1), prefault=True)
        self._views: dict[str, torch.Tensor] = {}
        for plan, base in zip(self._plans, self._bases, strict=True):
            for e in plan.entries:
                start = base + e.start
                view = self.flat[start : start + e.nbytes].view(e.dtype).view(e.shape)
                staging.copy_into(view, given.fetch(e.name))
                self._views[e.name] = view
        self.label = f"{len(self._views)} tensors in a shared-memory arena"
        self._adopted: list[torch.Tensor] = []
        _live.add(self)

    @classmethod
    def adopt(cls, model: torch.nn.Module, bucket_mb: float | None = None) -> Arena:
        """An arena of `model`'s state dict whose views become the model's parameters and
        buffers (`.data` swapped: optimizers holding the parameters keep working)."""
        state = model.state_dict(keep_vars=True)
        owners: dict[tuple, str] = {}
        unique = {}
        for name, tensor in state.items():
            key = _identity(tensor)
            if key in owners:
                continue  # a tied weight: pushed once, under its first name
            owners[key] = name
            unique[name] = tensor.detach()
        arena = cls(unique, bucket_mb)
        # Every entry's owner is looked up before any storage is swapped: swapping a tied
        # weight's first name moves its other names' pointer too, and its key with it.
        targets = [(tensor, arena._views[owners[_identity(tensor)]]) for tensor in state.values()]
        for tensor, view in targets:
            tensor.data = view
            arena._adopted.append(tensor)
        return arena

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> the view holding it (write into these, never replace them)."""
        return dict(self._views)

    # ---- a push source (client.sources) ----------------------------------------------------

    def specs(self):
        return list(self._specs)

    def fetch(self, name: str) -> torch.Tensor:
        return self._views[name]

    def read_into(self, name: str, dst: torch.Tensor) -> bool:
        return False

    def plans(self, served: torch.dtype | None, budget_bytes: int, device: torch.device):
        """The arena's own layout for a CPU server (sent as it lies: the server casts), else
        None (stage as usual)."""
        return list(self._plans) if device.type == "cpu" else None

    def bucket_view(self, plan: staging.BucketPlan) -> torch.Tensor | None:
        """The segment's bytes of one of `plans()`'s buckets; None for any other plan."""
        if plan.index >= len(self._plans) or self._plans[plan.index] != plan:
            return None
        base = self._bases[plan.index]
        return self.flat[base : base + plan.nbytes]

    def close(self) -> None:
        """A push's end: nothing to let go (the arena lives as long as its owner keeps it)."""

    def release(self) -> None:
        """Let the segment go: adopted parameters get empty data, the arena drops its views.
        The segment leaves /dev/shm once nothing else (a view from `tensors()`) holds it."""
        for tensor in self._adopted:
            tensor.data = torch.empty(0, dtype=tensor.dtype)
        self._adopted.clear()
        self._views.clear()
        self.flat = torch.empty(0, dtype=torch.uint8)


_live: weakref.WeakSet[Arena] = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    """At exit, not at interpreter teardown (which may never free it): a server that mapped the
    segment keeps this process's shm manager alive, and with it any segment still held here."""
    for arena in list(_live):
        arena.release()


def _identity(tensor: torch.Tensor) -> tuple:
    """Two state-dict entries are one weight when they are the same view of the same memory."""
    if tensor.numel() == 0:
        return ("empty", id(tensor))
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
