"""The weight-update coordinator: one update at a time, validate, then copy, then bookkeeping.

Every transport (disk, pushed tensors, a distributed broadcast) runs through `WeightUpdater.run`:
 1. one update at a time (a lock, held for the whole update);
 2. the source is validated whole before the engine is touched (headers, names, shapes, dtypes);
 3. inside `engine.exclusive()` (no model step runs; the in-flight guard decides under the
    engine's own lock) the copies run in place; a failure after the first copy marks every
    tensor it had begun writing torn, and the engine refuses to generate until each of them
    is written again;
 4. on success the written tensors take the update's label and lose any torn mark
    (`versions`, WeightVersions: the one owner of labels, marks, step and counters; the
    updater creates it), the engine is told the new label, mix and torn tensors
    (Engine.weights_written), and the prefill cache is flushed if asked.

An update may carry the catalog that goes with its weights (`catalog_path`): it is built and
checked first, before the weights are, and a bad one refuses the whole update, nothing changed;
it is installed right after the copy, inside the same exclusive section, so no step runs on the
new weights with the old catalog or the reverse (Engine.install_catalog). A failure between the
copy and the install leaves the engine refusing to serve, saying why (Engine.catalog_failed),
until a catalog is installed.

It also holds SGLang's weight-update session (/begin_weight_update, /end_weight_update): updates
work with or without one; ending one reports the labels and fails while they are mixed or torn.
A session may carry the catalog instead: nothing computes while it is open, and its end installs
the catalog (or, with the weights mixed or torn, leaves the engine refusing).

`sync_hooks`: callables run with the name of each step of a sync that carries a catalog
("catalog_built", "weights_written") and its catalog path; test fault hooks
(grctl/testing/faults.py) raise there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from grctl.engine import catalog_swap
from grctl.errors import (
    Conflict,
    InternalError,
    WeightsInconsistentConflict,
    WeightsMixedConflict,
)
from grctl.model.device import bind_thread
from grctl.weights import apply
from grctl.weights.apply import WeightCopyError, Write
from grctl.weights.versions import WeightVersions

if TYPE_CHECKING:
    from grctl.engine.engine import Engine

T = TypeVar("T")

sync_hooks: list[Callable[[str, str], None]] = []  # (step, catalog path)


def _hook(step: str, catalog_path: str) -> None:
    for hook in sync_hooks:
        hook(step, catalog_path)


@dataclass
class UpdateOutcome:
    tensors_loaded: int
    num_aborted_requests: int
    flushed_cache: bool
    elapsed_ms: float
    num_bytes: int = 0  # written into the model, in its dtype
    # the label and step this update left, read under its lock (a reply reports these, not
    # whatever a later update has set since)
    weight_version: str = ""
    token_step: int | str | None = None
    catalog_version: int | None = None  # the catalog the update installed with its weights


class WeightUpdater:
    """One per engine: it owns the labels of the engine's weights from the engine's start."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.model = engine.model
        self.versions = WeightVersions(engine.model.config, engine.config.weight_version)
        self._lock = engine.weight_ops  # updates, reads, relabels and memory moves take turns
        # the served weights' size, taken while they are loaded (a release empties them)
        self.model_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        self._session_open = False
        self._session_catalog = None  # the catalog an open session installs at its end
        engine.memory.on_discard = self._discarded  # a release without a backup tears them

    def run(
        self,
        validate: Callable[[], list[Write]],
        fetch: Callable[[str], torch.Tensor],
        *,
        read_into: Callable[[str, torch.Tensor], bool] | None = None,
        after_copy: Callable[[], None] | None = None,
        weight_version: str | None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        count: bool = True,
        is_full: bool = False,
        on_refusal: Callable[[], None] | None = None,
        catalog_path: str | None = None,
    ) -> UpdateOutcome:
        """In its turn among the weight operations: validate (no engine hold), then copy inside
        the engine's exclusive section. Refused (503 memory_released) while the weights are
        released. `is_full`: the source is a whole checkpoint (every tensor takes the label).
        `on_refusal` runs when the update is refused before its copy, before the refusal is
        raised: a broadcast source still takes what the trainer sent. `catalog_path`: the
        catalog of these weights, built first and installed with them. `after_copy` runs in
        the exclusive section right after the copy: a source that checks what it wrote (a
        delta's checksums over the patched bytes) raises there a refusal once it has put back
        every byte it changed, and the update is refused with nothing relabelled or torn."""
        t0 = time.perf_counter()
        # A handler thread: receives, rebuilt IPC tensors and copies go to the model's device.
        bind_thread(next(self.model.parameters()).device)
        with self._lock, ExitStack() as section:
            catalog = None
            try:
                self.engine.require_weights("the weights cannot be written")
                if catalog_path is not None:
                    catalog = self.engine.catalogs.build(catalog_path)
                    _hook("catalog_built", catalog_path)
                writes = validate()
                num_aborted = section.enter_context(self.engine.exclusive(abort_all_requests))
            except Exception:
                if on_refusal is not None:
                    on_refusal()
                raise
            try:
                loaded = apply.copy(writes, fetch, read_into, apply.read_workers()) if writes else 0
                if after_copy is not None:
                    after_copy()
            except WeightCopyError as exc:
                self.versions.tear(exc.touched)
                self._tell_engine(None)
                raise
            flushed = False
            if flush_cache:
                self.engine.cache.clear()
                flushed = True
            elapsed_ms = (time.perf_counter() - t0) * 1000.0
            self.versions.record(
                [w.name for w in writes],
                weight_version,
                token_step=token_step,
                count=count,
                elapsed_ms=elapsed_ms,
                is_full=is_full,
            )
            self._tell_engine(self.versions.current)
            label, step = self.versions.current, self.versions.token_step
            catalog_version = None
            if catalog is not None:
                installed, ended = self._install(catalog, catalog_path)
                catalog_version, num_aborted = installed.version, num_aborted + ended
        num_bytes = sum(w.dst.numel() * w.dst.element_size() for w in writes)
        return UpdateOutcome(
            loaded,
            num_aborted,
            flushed,
            round(elapsed_ms, 3),
            num_bytes,
            label,
            step,
            catalog_version,
        )

    def _install(self, catalog, path: str):
        """Install the catalog of the weights just written; a failure leaves the engine
        refusing to serve, and is raised saying so."""
        try:
            _hook("weights_written", path)
            return catalog_swap.install(self.engine, catalog, with_weights=True)
        except Exception as exc:
            why = (
                f"the weights of version {self.versions.current!r} were written but their "
                f"catalog {path!r} could not be installed ({exc})"
            )
            catalog_swap.failed(self.engine, why)
            raise InternalError(
                f"{why}; generation is refused until a catalog is installed",
                hint="sync again with catalog_path, or POST /catalog/reload",
            ) from exc

    def _tell_engine(self, label: str | None) -> None:
        """What the engine must know of the weights after a write: label, mix, torn tensors."""
        self.engine.weights_written(
            label,
            self.versions.mix(),
            self.versions.describe_torn(),
            self.versions.describe_discarded(),
        )

    def read(self, fn: Callable[..., T], *args) -> T:
        """Run a read of the live weights (get_weights_by_name, weights_checker) in its turn,
        never inside an update or a memory move: a read sees one whole update or none of it,
        and never parameters a release emptied (503 memory_released while they are out)."""
        with self._lock:
            self.engine.require_weights("the weights cannot be read")
            return fn(*args)

    def set_version(self, new_version: str, abort_all_requests: bool = False) -> int:
        """Relabel every tensor (/update_weight_version); returns the number aborted. Running
        requests go on and report both versions, as in SGLang; an update in progress finishes
        first, so the relabel never lands between two of its copies."""
        with self._lock:
            self.versions.relabel(str(new_version))
            return self.engine.relabel(
                self.versions.current, self.versions.mix(), abort_all_requests
            )

    def begin_session(self, catalog_path: str | None = None) -> None:
        """Open the session; with `catalog_path`, build that catalog first (a bad one opens
        nothing) and hold every step until the end installs it."""
        with self._lock:
            if self._session_open:
                raise Conflict(
                    "a weight update session is already open",
                    hint="call /end_weight_update first",
                )
            if catalog_path is not None:
                self._session_catalog = (self.engine.catalogs.build(catalog_path), catalog_path)
                _hook("catalog_built", catalog_path)
                catalog_swap.hold(self.engine, f"catalog {catalog_path!r}")
            self._session_open = True

    def end_session(self) -> str:
        """Close the session; the label counts as a message. Raises (the session closed all the
        same) when it leaves the weights mixed."""
        with self._lock:
            if not self._session_open:
                raise Conflict(
                    "no weight update session is open", hint="call /begin_weight_update first"
                )
            self._session_open = False
            held, self._session_catalog = self._session_catalog, None
            refusal = None
            if self.engine.gate.is_mixed:
                refusal = self.engine.gate.mixed_error(WeightsMixedConflict)
            elif not self.engine.gate.is_consistent:
                refusal = self.engine.gate.torn_error(WeightsInconsistentConflict)
            if refusal is not None:
                if held is not None:
                    catalog_swap.failed(
                        self.engine,
                        f"the weight update session ended with its weights unfinished, so its "
                        f"catalog {held[1]!r} was not installed",
                    )
                raise refusal
            message = f"weight update session ended; {self.versions.describe_mix()}"
            if held is not None:
                installed, ended = self._install(*held)
                message += f"; catalog version {installed.version} installed"
                if ended:
                    message += f" ({ended} requests under the old catalog ended)"
            return message

    def _discarded(self, param_names: list[str]) -> None:
        """A memory release discarded these parameters' bytes (no host backup): they come
        back as zeros, so nothing is served (503 weights_discarded) until each is written
        again; unlike torn tensors they do not hold the pause (verl and AReaL resume, then
        push). Runs inside the resume's exclusive section, holding weight_ops."""
        self.versions.discard(param_names)
        self._tell_engine(None)

    def reset_tensors(self, skip: list[str] | None = None) -> int:
        """weights_checker reset_tensors: overwrite every tensor not in `skip` (name substrings)
        with noise, in place. Noise is no checkpoint: every reset tensor is marked torn, as
        after a failed copy, so nothing is served (503, /ready says weights_inconsistent) until
        each of them is written again."""
        from grctl.weights.checker import WeightsChecker, checked_views

        with self._lock, self.engine.exclusive(False):
            names = [name for name, _ in checked_views(self.model, skip)]
            self.versions.tear(names)  # before the first write: a failure part-way is torn too
            try:
                return WeightsChecker.reset_tensors(self.model, skip)
            finally:
                self._tell_engine(None)
