"""The weight-update coordinator: one update at a time, validate, then copy, then bookkeeping.

Every transport (disk, pushed tensors, a distributed broadcast) runs through `WeightUpdater.run`:
 1. one update at a time (a lock, held for the whole update);
 2. the source is validated whole before the engine is touched (headers, names, shapes, dtypes);
 3. inside `engine.exclusive()` (no model step runs; the in-flight guard decides under the
    engine's own lock) the copies run in place; a failure after the first copy marks the
    weights inconsistent, and the engine refuses to generate until a later update succeeds;
 4. on success the version, step and counters move, and the prefill cache is flushed if asked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from grctl.engine.device import bind_thread
from grctl.weights import apply
from grctl.weights.apply import WeightCopyError, Write

T = TypeVar("T")


@dataclass
class WeightsInfo:
    weight_version: str = "default"
    token_step: int | str | None = None
    weight_update_count: int = 0
    last_weight_update_ms: float | None = None

    def as_dict(self) -> dict:
        return {
            "weight_version": self.weight_version,
            "token_step": self.token_step,
            "weight_update_count": self.weight_update_count,
            "last_weight_update_ms": self.last_weight_update_ms,
        }


@dataclass
class UpdateOutcome:
    tensors_loaded: int
    num_aborted_requests: int
    flushed_cache: bool
    elapsed_ms: float
    num_bytes: int = 0  # written into the model, in its dtype


class WeightUpdater:
    def __init__(self, engine, weight_version: str = "default"):
        self.engine = engine
        self.model = engine.model
        self.info = WeightsInfo(weight_version=weight_version)
        self._lock = threading.Lock()

    def run(
        self,
        validate: Callable[[], list[Write]],
        fetch: Callable[[str], torch.Tensor],
        *,
        read_into: Callable[[str, torch.Tensor], bool] | None = None,
        weight_version: str | None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        count: bool = True,
    ) -> UpdateOutcome:
        """Validate (no engine hold), then copy inside the engine's exclusive section."""
        t0 = time.perf_counter()
        # A handler thread: receives, rebuilt IPC tensors and copies go to the model's device.
        bind_thread(next(self.model.parameters()).device)
        with self._lock:
            writes = validate()
            with self.engine.exclusive(abort_all_requests) as num_aborted:
                try:
                    loaded = (
                        apply.copy(writes, fetch, read_into, apply.read_workers()) if writes else 0
                    )
                except WeightCopyError:
                    self.engine.set_weights_state(None, consistent=False)
                    raise
                new_version = self.info.weight_version if weight_version is None else weight_version
                self.engine.set_weights_state(str(new_version), consistent=True)
                flushed = False
                if flush_cache:
                    self.engine.clear_prefill_cache()
                    flushed = True
                self.info.weight_version = str(new_version)
                if token_step is not None:
                    self.info.token_step = token_step
                if count:
                    self.info.weight_update_count += 1
            elapsed_ms = (time.perf_counter() - t0) * 1000.0
            self.info.last_weight_update_ms = round(elapsed_ms, 3)
        num_bytes = sum(w.dst.numel() * w.dst.element_size() for w in writes)
        return UpdateOutcome(loaded, num_aborted, flushed, round(elapsed_ms, 3), num_bytes)

    def read(self, fn: Callable[..., T], *args) -> T:
        """Run a read of the live weights (get_weights_by_name, weights_checker) between two
        updates, never inside one: a read sees one whole update or none of it."""
        with self._lock:
            return fn(*args)

    def set_version(self, new_version: str, abort_all_requests: bool = False) -> int:
        """Relabel the live weights (/update_weight_version); returns the number aborted."""
        with self._lock, self.engine.exclusive(abort_all_requests) as num_aborted:
            consistent = self.engine.is_weights_consistent
            self.engine.set_weights_state(str(new_version), consistent=consistent)
            self.info.weight_version = str(new_version)
        return num_aborted

    def reset_tensors(self) -> int:
        """weights_checker reset_tensors: overwrite every parameter with noise, in place."""
        from grctl.weights.checker import WeightsChecker

        with self._lock, self.engine.exclusive(False):
            n = WeightsChecker.reset_tensors(self.model)
            self.engine.set_weights_state(None, consistent=self.engine.is_weights_consistent)
            return n
