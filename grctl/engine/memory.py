"""MemorySaver: SGLang's release/resume_memory_occupation for a colocated trainer (verl).

Tags, as SGLang names them (none = all three):
  kv_cache    the prefill cache's context KV (requests hold none: release needs an idle engine)
  weights     every parameter is copied to host memory (pinned on CUDA; a CPU model keeps its
              own tensors) and its data replaced by an empty tensor; resume copies it back into
              the SAME Parameter objects (so tied weights stay tied and every holder of a
              parameter sees it come back), at a new device address
  cuda_graph  the captured decode graphs and their static buffers
Freed device memory goes back to the driver (torch.cuda.empty_cache). Graphs hold the weights'
device addresses, so releasing weights drops them too; they are captured again, with the same
buckets, once nothing is released any more. The engine (engine.py) runs these under its lock
protocol; this class only moves memory and keeps the record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from grctl.errors import MemoryReleased, ValidationError
from grctl.model.device import bind_thread

log = logging.getLogger("grctl.engine")

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


def empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class MemorySaver:
    def __init__(self) -> None:
        self.released: set[str] = set()
        self._backups: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._recapture: Callable | None = None  # DecodeGraphs' factory while graphs are gone

    def is_released(self, tag: str | None = None) -> bool:
        return bool(self.released) if tag is None else tag in self.released

    # ---- release ------------------------------------------------------------------------
    def release(self, engine, tags: tuple[str, ...]) -> None:
        bind_thread(engine.device)  # a handler thread: copies and frees on the model's device
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
        backups = []
        for p in model.parameters():  # a tied weight is one Parameter: one backup
            if p.device.type == "cpu":  # already in host memory: keep it, copy nothing
                backup = p.detach()
            else:
                backup = torch.empty(p.shape, dtype=p.dtype, pin_memory=p.device.type == "cuda")
                backup.copy_(p.detach())
            backups.append((p, backup))
        # Every copy is made before any device memory is freed: a failure above frees nothing.
        for p, _ in backups:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._backups = backups

    # ---- resume -------------------------------------------------------------------------
    def resume(self, engine, tags: tuple[str, ...]) -> None:
        bind_thread(engine.device)
        todo = [t for t in tags if t in self.released]
        if "weights" in todo:
            self._restore_weights()
        self.released.difference_update(todo)
        if not self.released and self._recapture is not None and engine.config.cuda_graph:
            factory, self._recapture = self._recapture, None
            try:
                engine.runner.graphs = factory(engine.model, engine.device)
            except Exception as exc:  # serve eagerly rather than not at all (as at start)
                log.exception("CUDA graph re-capture after resume failed; decode runs eagerly")
                engine.stats.record_error(exc)

    def _restore_weights(self) -> None:
        for p, backup in self._backups:
            p.data = backup.to(p.device)
        self._backups = []

    def error(self, what: str) -> MemoryReleased:
        released = ", ".join(sorted(self.released))
        return MemoryReleased(
            f"memory is released ({released}): {what}",
            hint="POST /resume_memory_occupation (tags null: all) first",
        )

    def stats(self) -> dict:
        return {
            "released": sorted(self.released),
            "offloaded_weight_bytes": sum(b.numel() * b.element_size() for _, b in self._backups),
        }
