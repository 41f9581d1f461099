"""The tensor transport: one pushed chunk (SGLang's wire format), validated whole, then applied.

Chunks are independent: each is planned against the live model and copied on its own, with no
buffering and no wait for a "last" chunk. An empty bucket or list is a successful no-op. The
decoded tensors are views of the client's memory (CUDA IPC or shared memory): every reference is
dropped before the reply, so the client may free or reuse its buffers at once. Shared-memory
tensors are read from their segments with pread (grctl.weights.shm_reads), not through the
mapping: for a CPU model straight into the parameters, on the sink's read threads.
"""

from __future__ import annotations

from grctl.errors import WeightValidationError
from grctl.weights import apply
from grctl.weights.shm_reads import SegmentReads
from grctl.weights.updater import UpdateOutcome, WeightUpdater
from grctl.weights.wire.decode import decode_payload


def first_entry(serialized_named_tensors: object) -> str | bytes:
    """Entry 0 of the per-TP-rank list; grctl has one rank and ignores the others."""
    if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
        raise WeightValidationError(
            "serialized_named_tensors must be a non-empty list (one entry per TP rank)"
        )
    entry = serialized_named_tensors[0]
    if not isinstance(entry, (str, bytes)):
        raise WeightValidationError("serialized_named_tensors[0] must be a base64 string")
    return entry


def update_from_tensor(
    updater: WeightUpdater,
    serialized_named_tensors: object,
    load_format: str | None,
    *,
    weight_version: str | None,
    token_step: int | str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    catalog_path: str | None = None,  # the catalog of these weights, installed with them
) -> UpdateOutcome:
    named = decode_payload(first_entry(serialized_named_tensors), load_format)
    by_name = dict(named)
    direct = load_format == "direct"  # direct: parameter names (fused) with exact shapes
    on_cpu = next(updater.model.parameters()).device.type == "cpu"
    segments = SegmentReads(named)
    try:
        return updater.run(
            lambda: apply.plan(
                updater.model,
                apply.specs_of(named),
                require_full=False,
                allow_fused=direct,
                allow_split=not direct,
            ),
            lambda name: segments.fetch(name, by_name[name]),
            read_into=segments.read_into if on_cpu else None,
            weight_version=weight_version,
            token_step=token_step,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            catalog_path=catalog_path,
        )
    finally:
        segments.close()
        named.clear()
        by_name.clear()
