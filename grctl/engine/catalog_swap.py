"""The catalog that goes with the weights: installed at a step boundary, under the engine's
gate, so no step runs between a weight write and its catalog (docs/catalog.md).

The weights side calls these inside its exclusive section (a sync that carries a catalog) and
the catalog route for a plain reload."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
        installed = engine.catalogs.install(catalog, gate.label)
        gate.catalog_fault = gate.catalog_pending = None
        gate.notify()
        return installed, ended


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
