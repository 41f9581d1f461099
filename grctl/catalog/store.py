"""CatalogStore: the served catalog, its version, and the one before it.

A reload parses and builds the new catalog beside the old one (no lock held: requests keep being
served from the old one), then swaps the reference under the lock. A Catalog is never changed
after it is built, so a request that took a reference at submit keeps its version to the end.
Rollback returns to the catalog served before the last swap (one level of history).

`build` and `install` are the two halves of a reload, apart: a weight update that carries its
catalog builds it before touching the weights and installs it (through the engine, under its
lock, inside the update's exclusive section) once the weights are written. Each installed
catalog is labelled with the weight version it is served with.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from grctl import heap
from grctl.catalog.loader import ItemIds, read_catalog
from grctl.catalog.trie import Trie
from grctl.errors import Conflict, Forbidden, ValidationError


@dataclass(frozen=True)
class Catalog:
    version: int
    trie: Trie
    ids: ItemIds
    source: str
    loaded_at: float  # unix time
    file_bytes: int
    weight_version: str | None = None  # the weights' label when it was installed
    # the engine gate's weight generation when it was installed (moves with every weight
    # write): a rollback to a catalog of other weights is refused (engine/catalog_swap.py)
    weights_generation: int | None = None

    @property
    def nbytes(self) -> int:
        return self.trie.nbytes + self.ids.nbytes

    def item_ids(self, node: int) -> list[int | str]:
        return [self.ids.get(int(i)) for i in self.trie.items_of(node)]

    def status(self) -> dict:
        s = self.trie.stats
        return {
            "version": self.version,
            "num_items": s.num_items,
            "num_paths": s.num_paths,
            "max_depth": s.max_depth,
            "nbytes": self.nbytes,
            "source": self.source,
            "loaded_at": self.loaded_at,
            "num_nodes": s.num_nodes,
            "num_collision_paths": s.num_collision_paths,
            "num_shadowed_items": s.num_shadowed_items,
            "self_delimiting": s.self_delimiting,
            "weight_version": self.weight_version,
        }


def build_catalog(
    path: str,
    version: int,
    device: torch.device,
    *,
    vocab_size: int | None = None,
    max_bytes: int | None = None,
    root: str | None = None,
) -> Catalog:
    rows = read_catalog(path, max_bytes=max_bytes, vocab_size=vocab_size, root=root)
    trie = Trie(rows.paths, rows.lengths, device)
    catalog = Catalog(version, trie, rows.ids, path, time.time(), rows.file_bytes)
    del rows
    heap.release_freed()  # the parse's freed heap, or it counts as resident for good
    return catalog


class CatalogStore:
    def __init__(
        self,
        device: torch.device,
        vocab_size: int,
        *,
        max_bytes: int | None = None,
        root: str | None = None,
    ):
        self.device = device
        self.vocab_size = vocab_size
        self.max_bytes = max_bytes
        self.root = root  # catalog paths must resolve under it (--weights-root)
        self._lock = threading.Lock()
        self._reload_lock = threading.Lock()  # one build at a time
        self._current: Catalog | None = None
        self._previous: Catalog | None = None
        self._last_version = 0
        self.num_reloads = 0
        self.num_rollbacks = 0

    @property
    def current(self) -> Catalog | None:
        return self._current

    def checked_path(self, path: object) -> str:
        if not isinstance(path, str) or not path:
            raise ValidationError('"path" must be a non-empty string naming a catalog JSONL file')
        if "\x00" in path:
            raise ValidationError("path contains a NUL byte")
        if self.root is not None:
            resolved, allowed = Path(path).resolve(), Path(self.root).resolve()
            if resolved != allowed and allowed not in resolved.parents:
                raise Forbidden(
                    f"catalog path {path!r} resolves outside the weights root",
                    hint=f"catalogs may only be read under {str(allowed)!r} (--weights-root)",
                )
        return path

    def load(
        self,
        path: str,
        *,
        confine: bool = True,
        weight_version: str | None = None,
        weights_generation: int | None = None,
    ) -> Catalog:
        """Build the catalog at `path` and serve it; on any error the old one keeps serving.
        `confine=False` (the operator's own --catalog) skips the --weights-root check."""
        catalog = self.build(path, confine=confine)
        return self.install(catalog, weight_version, weights_generation)

    def build(self, path: str, *, confine: bool = True) -> Catalog:
        """The catalog at `path`, built and checked, not served (its version is given when it
        is installed). Raises ValidationError naming what is wrong; nothing changes."""
        path = self.checked_path(path) if confine else path
        with self._reload_lock:
            return build_catalog(
                path,
                0,
                self.device,
                vocab_size=self.vocab_size,
                max_bytes=self.max_bytes,
                root=self.root if confine else None,
            )

    def install(
        self,
        catalog: Catalog,
        weight_version: str | None = None,
        weights_generation: int | None = None,
    ) -> Catalog:
        """Serve a built catalog from now on, numbered after the last one and labelled with the
        weights' version (and generation); the one it replaces becomes the rollback target."""
        with self._lock:
            self._last_version += 1
            catalog = replace(
                catalog,
                version=self._last_version,
                weight_version=weight_version,
                weights_generation=weights_generation,
            )
            self._previous, self._current = self._current, catalog
            self.num_reloads += 1
        return catalog

    @property
    def previous(self) -> Catalog | None:
        """What a rollback would serve."""
        return self._previous

    def rollback(
        self, weight_version: str | None = None, weights_generation: int | None = None
    ) -> Catalog:
        """Serve the previous catalog again, labelled with the weights it is served with now."""
        with self._reload_lock, self._lock:
            if self._previous is None:
                raise Conflict(
                    "there is no previous catalog to roll back to",
                    hint="rollback undoes one /catalog/reload",
                )
            again = replace(
                self._previous, weight_version=weight_version, weights_generation=weights_generation
            )
            self._current, self._previous = again, None
            self.num_rollbacks += 1
            return self._current

    def status(self) -> dict:
        cur, prev = self._current, self._previous
        out = cur.status() if cur is not None else {"version": None, "num_items": 0}
        out["loaded"] = cur is not None
        out["previous_version"] = prev.version if prev is not None else None
        out["num_reloads"] = self.num_reloads
        out["num_rollbacks"] = self.num_rollbacks
        return out
