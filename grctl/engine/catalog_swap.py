"""The catalog that goes with the weights: installed at a step boundary, under the engine's
gate, so no step runs between a weight write and its catalog (docs/catalog.md).

The weights side calls these inside its exclusive section (a sync that carries a catalog) and
the catalog route for a plain reload."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grctl.errors import Conflict

if TYPE_CHECKING:
    from grctl.catalog.store import Catalog
    from grctl.engine.engine import Engine


def install(engine: Engine, catalog: Catalog, with_weights: bool) -> tuple[Catalog, int]:
    """Serve `catalog` from the next step on, labelled with the weights' version (holding the
    gate: a request queued from now on takes it). `with_weights`: it came with a weight write,
    so a request in flight under an older catalog would go on with the new weights and the old
    catalog: each ends (finish_reason abort). A plain reload leaves them on their own version.
    Clears a catalog fault. -> (the installed catalog, how many ended)."""
    gate = engine.gate
    with gate:
        ended = 0
        if with_weights:
            for seq in engine.scheduler.all_sequences():
                if seq.catalog is not None:
                    engine.worker.abort(seq)
                    ended += 1
        installed = engine.catalogs.install(catalog, gate.label, gate.generation)
        gate.catalog_fault = gate.catalog_pending = None
        gate.notify()
        return installed, ended


def rollback(engine: Engine, force: bool = False) -> Catalog:
    """Serve the catalog from before the last install again. One installed with other weights
    than the ones served now (a push with --catalog since) would pair those weights with the
    wrong items: a 409 `conflict` unless `force`. The catalog served again is labelled with
    the weights it now goes with."""
    gate = engine.gate
    with gate:
        prev = engine.catalogs.previous
        other = prev is not None and prev.weights_generation not in (None, gate.generation)
        if other and not force:
            raise Conflict(
                f"the previous catalog (version {prev.version}) went with other weights (version "
                f"{prev.weight_version!r}) than the ones served now ({gate.label!r}): rolling "
                "back would serve these weights with another catalog",
                hint="push the previous weights with their catalog (grctl push --catalog), or "
                'roll back anyway with {"force": true} (grctl catalog rollback --force)',
            )
        return engine.catalogs.rollback(gate.label, gate.generation)


def failed(engine: Engine, why: str) -> None:
    """The weights were written but their catalog is not served: refuse until it is."""
    gate = engine.gate
    with gate:
        gate.catalog_fault, gate.catalog_pending = why, None
        gate.notify()


def hold(engine: Engine, what: str | None) -> None:
    """A session carries the weights' catalog (`what` describes it): nothing computes or is
    admitted until it is installed; None lets go."""
    gate = engine.gate
    with gate:
        gate.catalog_pending = what
        gate.notify()
