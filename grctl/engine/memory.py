"""MemorySaver: SGLang's release/resume_memory_occupation for a colocated trainer (verl).

Tags, as SGLang names them (none = all three):
  kv_cache    the prefix cache's KV (requests hold none: release needs an idle engine)
  weights     every parameter's data is replaced by an empty tensor. By default (SGLang's
              enable_weights_cpu_backup=False, vLLM's level-2 sleep) its bytes are discarded:
              resume gives it zeroed storage of its shape and the weights side marks it torn,
              so nothing is served (503 weights_inconsistent) until the trainer writes it
              again, as it does after every resume. With a backup (--enable-weights-cpu-backup,
              or a name in --preserve-parameter-names) it is first copied to host memory
              (pinned on CUDA; a CPU model keeps its own tensors) and resume copies it back.
              Either way into the SAME Parameter objects (so tied weights stay tied and every
              holder of a parameter sees it come back), at a new device address
  cuda_graph  the captured decode graphs and their static buffers
Freed device memory goes back to the driver (torch.cuda.empty_cache). Graphs hold the weights'
device addresses, so releasing weights drops them too; they are captured again, with the same
buckets, once nothing is released any more. Memory moves inside an exclusive section of the
Gate, which keeps the record of what is released; MemorySaver moves what it was given.

A release or resume holds the engine's `weight_ops` lock from start to end, the lock every weight
update and every read of the weights (WeightUpdater) holds too: they take turns, so an update
or a read arriving mid-release waits for it, then finds the weights released (503
memory_released) instead of writing into parameters already backed up, or reading emptied ones.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from grctl.errors import Conflict, ValidationError
from grctl.model.device import bind_thread

if TYPE_CHECKING:
    from grctl.engine.gate import Gate
    from grctl.engine.model_runner import ModelRunner
    from grctl.engine.prefix_cache import PrefixCache

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


def host_backup(p: torch.nn.Parameter) -> torch.Tensor:
    """What a released parameter comes back from: a host copy (pinned on CUDA); a parameter
    already in host memory is kept as it is, nothing copied."""
    if p.device.type == "cpu":
        return p.detach()
    backup = torch.empty(p.shape, dtype=p.dtype, pin_memory=p.device.type == "cuda")
    backup.copy_(p.detach())
    return backup


def empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class MemorySaver:
    def __init__(
        self,
        gate: Gate,
        model: torch.nn.Module,
        runner: ModelRunner,
        cache: PrefixCache,
        device: torch.device,
        *,
        weight_ops: threading.Lock,
        recapture: bool,
        on_error: Callable[[BaseException], None],
        backup_all: bool = False,
        preserve: tuple[str, ...] = (),
    ):
        self.gate = gate  # the section memory moves in, and the record of what is released
        self.model = model
        self.runner = runner  # its CUDA graphs go and come back
        self.cache = cache
        self.device = device
        self.is_recapture_on = recapture  # --cuda-graph
        self.on_error = on_error  # a failed re-capture is served eagerly, and counted here
        self._lock = weight_ops  # releases, resumes, updates and reads take turns
        self.is_backup_all = backup_all  # --enable-weights-cpu-backup
        self.preserve = preserve  # --preserve-parameter-names: backed up regardless
        # what resume restores: a host copy, or (discarded) the shape to give zeroed storage of
        self._backups: list[tuple[str, torch.nn.Parameter, torch.Tensor | torch.Size]] = []
        # the weights side's hook, told at resume the parameters whose bytes the release
        # discarded (it marks them torn: WeightUpdater), inside the resume's exclusive section
        self.on_discard: Callable[[list[str]], None] | None = None
        self._recapture: Callable | None = None  # DecodeGraphs' factory while graphs are gone

    @property
    def released(self) -> frozenset[str]:
        return self.gate.released

    def release(self, tags: Iterable[str] | None, is_busy: Callable[[], bool]) -> list[str]:
        """Free the memory of `tags`; refused while `is_busy()` (read holding the gate) or a
        weight update runs. Returns every tag released now."""
        tags = check_tags(tags)
        with self._section(is_busy):
            todo = [t for t in tags if t not in self.gate.released]
            self._free(todo)
            self.gate.set_released(self.gate.released.union(todo))
            return sorted(self.gate.released)

    def resume(self, tags: Iterable[str] | None) -> list[str]:
        tags = check_tags(tags)
        with self._section():
            todo = [t for t in tags if t in self.gate.released]
            if "weights" in todo:
                self._restore_weights()
            self.gate.set_released(self.gate.released.difference(todo))
            if not self.gate.released and self._recapture is not None and self.is_recapture_on:
                self._recapture_graphs()
            return sorted(self.gate.released)

    @contextmanager
    def _section(self, is_busy: Callable[[], bool] | None = None) -> Iterator[None]:
        """One move at a time, in its turn among the weight operations, inside an exclusive
        section: no step starts, and no update or read runs."""
        with self._lock:
            with self.gate:
                if is_busy is not None and (is_busy() or self.gate.num_exclusive):
                    raise Conflict(
                        "requests are in flight or a weight update runs; memory stays occupied",
                        hint="wait for them, or POST /pause_generation (mode abort) first",
                    )
                self.gate.enter_exclusive()
            try:
                bind_thread(self.device)  # a handler thread: copies and frees on the device
                yield
            finally:
                self.gate.leave_exclusive()

    def _free(self, todo: list[str]) -> None:
        if "cuda_graph" in todo or "weights" in todo:
            if self.runner.graphs is not None:
                self._recapture = self.runner.graphs.factory()
                self.runner.graphs = None
        if "kv_cache" in todo:
            self.cache.clear()
        if "weights" in todo:
            self._offload_weights()
        empty_device_cache(self.device)

    def is_kept(self, name: str) -> bool:
        # with no weights side to mark a discarded tensor torn (an engine used alone), nothing
        # may be discarded: it would come back as zeros and be served
        return (
            self.is_backup_all
            or self.on_discard is None
            or any(part in name for part in self.preserve)
        )

    def _offload_weights(self) -> None:
        # named_parameters lists a tied weight once: one backup
        named = list(self.model.named_parameters())
        backups = [(n, p, host_backup(p) if self.is_kept(n) else p.shape) for n, p in named]
        # Every copy is made before any device memory is freed: a failure above frees nothing.
        for _, p, _ in backups:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._backups = backups

    def _restore_weights(self) -> None:
        discarded = [n for n, _, backup in self._backups if isinstance(backup, torch.Size)]
        if discarded:  # torn from now on, until the trainer writes them (WeightUpdater)
            self.on_discard(discarded)
        for _, p, backup in self._backups:
            if isinstance(backup, torch.Size):
                p.data = torch.zeros(backup, dtype=p.dtype, device=p.device)
            else:
                p.data = backup.to(p.device)
        self._backups = []

    def _recapture_graphs(self) -> None:
        factory, self._recapture = self._recapture, None
        try:
            self.runner.graphs = factory(self.model, self.device)
        except Exception as exc:  # serve eagerly rather than not at all (as at start)
            log.exception("CUDA graph re-capture after resume failed; decode runs eagerly")
            self.on_error(exc)

    def stats(self) -> dict:
        return {
            "released": sorted(self.gate.released),
            "offloaded_weight_bytes": sum(
                b.numel() * b.element_size()
                for _, _, b in self._backups
                if isinstance(b, torch.Tensor)
            ),
            "discarded_weight_bytes": sum(
                p.dtype.itemsize * b.numel()
                for _, p, b in self._backups
                if isinstance(b, torch.Size)
            ),
        }
