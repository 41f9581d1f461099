"""MemorySaver: SGLang's release/resume_memory_occupation for a colocated trainer (verl).

Tags, as SGLang names them (none = all three):
  kv_cache    the prefill cache's context KV (requests hold none: release needs an idle engine)
  weights     every parameter's storage is copied to host memory and resized to 0 bytes; resume
              resizes the SAME storage objects back and copies the bytes in, so every parameter,
              view and tied weight stays the object it was (only the device address may move)
  cuda_graph  the captured decode graphs and their static buffers
Freed device memory goes back to the driver (torch.cuda.empty_cache). Graphs hold the weights'
device addresses, so releasing weights drops them too; they are captured again, with the same
buckets, once nothing is released any more. The engine (engine.py) runs these under its lock
protocol; this class only moves memory and keeps the record.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch

from grctl.errors import MemoryReleased, ValidationError

TAGS = ("kv_cache", "weights", "cuda_graph")


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """SGLang's tags argument: None (or empty) means all; anything else must be a known tag."""
    if tags is None:
        return TAGS
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValidationError('tags must be a list of strings, e.g. ["kv_cache", "weights"]')
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValidationError(f"unknown tag(s) {unknown}; use {', '.join(TAGS)} (or null: all)")
    return tuple(dict.fromkeys(tags)) or TAGS


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (storage.nbytes(),))


def empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class MemorySaver:
    def __init__(self) -> None:
        self.released: set[str] = set()
        self._backups: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._recapture: Callable | None = None  # DecodeGraphs' factory while graphs are gone

    def is_released(self, tag: str | None = None) -> bool:
        return bool(self.released) if tag is None else tag in self.released

    # ---- release ------------------------------------------------------------------------
    def release(self, engine, tags: tuple[str, ...]) -> None:
        todo = [t for t in tags if t not in self.released]
        if "cuda_graph" in todo or "weights" in todo:
            self._drop_graphs(engine.runner)
        if "kv_cache" in todo:
            engine.cache.clear()
        if "weights" in todo:
            self._offload_weights(engine.model)
        self.released.update(todo)
        empty_device_cache(engine.device)

    def _drop_graphs(self, runner) -> None:
        if runner.graphs is not None:
            self._recapture = runner.graphs.factory()
            runner.graphs = None

    def _offload_weights(self, model: torch.nn.Module) -> None:
        seen: set[int] = set()
        pin = next(model.parameters()).device.type == "cuda"
        try:
            for t in itertools.chain(model.parameters(), model.buffers()):
                storage = t.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue  # tied weights and views share one storage: one backup
                seen.add(storage.data_ptr())
                backup = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                backup.copy_(_bytes_view(storage))
                self._backups.append((storage, backup))
                storage.resize_(0)
        except Exception:
            self._restore_weights()  # all or nothing: put back what was already taken
            raise

    # ---- resume -------------------------------------------------------------------------
    def resume(self, engine, tags: tuple[str, ...]) -> None:
        todo = [t for t in tags if t in self.released]
        if "weights" in todo:
            self._restore_weights()
        self.released.difference_update(todo)
        if not self.released and self._recapture is not None and engine.config.cuda_graph:
            factory, self._recapture = self._recapture, None
            engine.runner.graphs = factory(engine.model, engine.device)

    def _restore_weights(self) -> None:
        for storage, backup in self._backups:
            storage.resize_(backup.numel())
            _bytes_view(storage).copy_(backup, non_blocking=False)
        self._backups.clear()

    def error(self, what: str) -> MemoryReleased:
        released = ", ".join(sorted(self.released))
        return MemoryReleased(
            f"memory is released ({released}): {what}",
            hint="POST /resume_memory_occupation (tags null: all) first",
        )

    def stats(self) -> dict:
        return {
            "released": sorted(self.released),
            "offloaded_weight_bytes": sum(b.numel() for _, b in self._backups),
        }
