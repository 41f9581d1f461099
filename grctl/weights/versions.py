"""WeightVersions: the one owner of the served weights' version labels and update counters.

Every HF tensor of the served model (`model.layers.0.self_attn.q_proj.weight`, ...) carries the
label of the update that last wrote it. Labels are kept per HF tensor, not per fused parameter,
because a chunk may hold only q_proj: it writes rows 0:q of `qkv_proj`, and those rows alone
take the chunk's label. The weights are *mixed* while the tensors carry more than one label:
then the engine refuses to serve them (unless partial updates are allowed).

    versions = WeightVersions(cfg, "step-6")
    versions.record(["model.norm.weight"], "step-7")   # mixed: 1 tensor 'step-7', N-1 'step-6'
    versions.relabel("step-7")                          # every tensor 'step-7' again

A copy that fails part-way leaves the tensors it may have touched *torn*: their bytes are
neither their label's nor the failed update's. The mark is part of each tensor's entry; only a
later successful write of that tensor removes it (a relabel never does), and while any tensor
is torn the engine refuses to serve, as it does for a mix.

    versions.tear(["model.norm.weight"])               # a copy failed while writing it
    versions.record([], "v2")                          # an empty chunk: still torn
    versions.record(["model.norm.weight"], None)       # written again: whole

`current` is the label a reply reports (/get_weight_version, meta_info.weight_version): the last
one an update or a relabel set. One lock guards the table. The WeightUpdater owns it and tells
the engine the label, the mix and the torn tensors after each change, inside the update's
exclusive section, so no step runs between an update and its labels.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from grctl.model.config import ModelConfig
from grctl.weights.mapping import hf_names, resolve

Rows = tuple[int | None, int | None]  # (None, None): the whole parameter


class WeightVersions:
    def __init__(self, cfg: ModelConfig, label: str = "default"):
        self.cfg = cfg
        # parameter name -> its HF tensors and the rows each one covers
        self._units: dict[str, list[tuple[str, Rows]]] = {}
        for name in hf_names(cfg):
            target = resolve(name, cfg)
            rows = (target.row_start, target.row_end)
            self._units.setdefault(target.param_name, []).append((name, rows))
        self._labels = dict.fromkeys(hf_names(cfg), str(label))
        self._torn: set[str] = set()  # HF tensors a failed copy may have touched
        # HF tensors a memory release discarded (no host backup): zeros until written again
        self._discarded: set[str] = set()
        self.current = str(label)
        self.token_step: int | str | None = None
        self.update_count = 0
        self.last_update_ms: float | None = None
        self.is_mixed = False
        self._lock = threading.Lock()

    def written_tensors(self, source_names: Iterable[str]) -> set[str]:
        """The HF tensors that writes of `source_names` (HF, or fused parameter names) cover."""
        out: set[str] = set()
        for name in source_names:
            target = resolve(name, self.cfg)
            if target is None:
                continue
            for hf_name, (start, end) in self._units.get(target.param_name, ()):
                if not target.is_shard or (start, end) == (target.row_start, target.row_end):
                    out.add(hf_name)
        return out

    def record(
        self,
        source_names: Iterable[str],
        label: str | None,
        *,
        token_step: int | str | None = None,
        count: bool = True,
        elapsed_ms: float | None = None,
        is_full: bool = False,
    ) -> None:
        """A successful update wrote `source_names`. With a label, those tensors take it; without
        one they keep theirs (an unlabelled single-tensor update stays unmixed, as in SGLang).
        `is_full`: the update wrote the whole model from one checkpoint, so every tensor takes
        the update's label (or, without one, the current label). Either way the tensors it
        wrote are whole again: their torn marks go."""
        written = set(self._labels) if is_full else self.written_tensors(source_names)
        with self._lock:
            new = self.current if label is None else str(label)
            if label is not None or is_full:
                for name in written:
                    self._labels[name] = new
            self._torn -= written
            self._discarded -= written
            self.current = new
            if token_step is not None:
                self.token_step = token_step
            if count:
                self.update_count += 1
            if elapsed_ms is not None:
                self.last_update_ms = round(elapsed_ms, 3)
            self._refresh()

    def tear(self, source_names: Iterable[str]) -> None:
        """A copy failed after it began: every tensor of `source_names` (the writes it had
        started) is torn until a later successful write of that tensor."""
        touched = self.written_tensors(source_names)
        with self._lock:
            self._torn |= touched

    def discard(self, source_names: Iterable[str]) -> None:
        """A memory release dropped these tensors' bytes: they come back as zeros, and are
        not served until a later write of each (the trainer's push after resume)."""
        touched = self.written_tensors(source_names)
        with self._lock:
            self._discarded |= touched

    def discarded(self) -> list[str]:
        with self._lock:
            return sorted(self._discarded)

    def describe_discarded(self) -> str | None:
        gone = self.discarded()
        if not gone:
            return None
        shown = ", ".join(gone[:4]) + (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
        return f"{len(gone)} tensors were released without a host copy: {shown}"

    def torn(self) -> list[str]:
        """The torn HF tensors, sorted."""
        with self._lock:
            return sorted(self._torn)

    def describe_torn(self) -> str | None:
        """'2 tensors hold bytes of a failed copy: a, b' while any is torn, else None: what the
        engine is told, and what its refusals say."""
        torn = self.torn()
        if not torn:
            return None
        shown = ", ".join(torn[:8]) + (f" and {len(torn) - 8} more" if len(torn) > 8 else "")
        return f"{len(torn)} tensors hold bytes of no checkpoint (a failed copy or reset): {shown}"

    def relabel(self, label: str) -> None:
        """/update_weight_version: every tensor takes `label` (an operator's word for the mix).
        Torn tensors stay torn: a label says nothing of their bytes."""
        with self._lock:
            self._labels = dict.fromkeys(self._labels, str(label))
            self.current = str(label)
            self._refresh()

    def _refresh(self) -> None:
        self.is_mixed = len(set(self._labels.values())) > 1

    def label_counts(self) -> dict[str, int]:
        """label -> how many HF tensors carry it, most common first."""
        with self._lock:
            return dict(Counter(self._labels.values()).most_common())

    def labels(self) -> dict[str, str]:
        with self._lock:
            return dict(self._labels)

    def mix(self) -> str | None:
        """describe_mix() while the weights are mixed, else None: what the engine is told."""
        return self.describe_mix() if self.is_mixed else None

    def describe_mix(self) -> str:
        """'20 tensors carry version 'B', 26 carry 'A'' (for errors and /end_weight_update)."""
        counts = self.label_counts()
        parts = [f"{n} carry version {label!r}" for label, n in counts.items()]
        total = sum(counts.values())
        return f"{total} tensors: " + ", ".join(parts)

    def as_dict(self) -> dict:
        """What /status reports under "weights"."""
        torn = self.torn()
        return {
            "weight_version": self.current,
            "token_step": self.token_step,
            "weight_update_count": self.update_count,
            "last_weight_update_ms": self.last_update_ms,
            "weights_mixed": self.is_mixed,
            "label_counts": self.label_counts(),
            "weights_torn": bool(torn),
            "torn_tensors": torn,
            "discarded_tensors": self.discarded(),
        }
