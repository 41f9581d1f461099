"""The disk transport: an HF checkpoint directory read by the server, validated whole from its
headers (structure, names, shapes, dtypes, coverage, file sizes), then streamed in tensor by
tensor: peak extra host memory is about one tensor, not the checkpoint."""

from __future__ import annotations

from grctl.weights.checkpoint import Checkpoint, plan_checkpoint
from grctl.weights.updater import UpdateOutcome, WeightUpdater


def update_from_disk(
    updater: WeightUpdater,
    path: str,
    *,
    weight_version: str | None,
    token_step: int | str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    catalog_path: str | None = None,  # the catalog of these weights, installed with them
    root: str | None = None,  # --weights-root: every file opened is checked inside it
) -> UpdateOutcome:
    model = updater.model
    with Checkpoint(path, root=root) as ckpt:
        return updater.run(
            lambda: plan_checkpoint(model, ckpt),
            ckpt.fetch,
            read_into=ckpt.read_into,
            weight_version=weight_version,
            token_step=token_step,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            catalog_path=catalog_path,
            is_full=True,  # a whole checkpoint: every tensor takes the label
        )
