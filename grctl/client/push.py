"""One server's tensor push without the pause around it: what `GRClient.push_tensors` runs.

For a trainer that drives the sequence itself (slime's order: pause, flush, push, continue).
The same pieces as WeightSync's tensor stage: the source planned against the served structure
before the first bucket, buckets staged on the server's device (shared memory for a CPU server,
its GPU for a CUDA one), one update_weights_from_tensor call per bucket, the prefill cache
flushed by the last one.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from grctl.client import devices, sources, staging
from grctl.client.outcome import ServerOutcome, SyncError, SyncInterrupted, SyncResult, stopped_by
from grctl.client.pipeline import PushOptions, Target, push_buckets
from grctl.client.preflight import check_covers
from grctl.client.verify import dtype_of
from grctl.errors import ValidationError
from grctl.protocol.weights import version_str


def push_tensors(
    client,
    named_tensors,
    *,
    bucket_mb: float = 512,
    weight_version: str | int | None = None,
    token_step: int | str | None = None,
    flush_cache: bool = True,
    stage_device: str | None = None,
) -> SyncResult:
    """Push `named_tensors` (a state dict or (hf_name, tensor) pairs, CPU or CUDA; or a
    checkpoint path) to `client`'s server. Raises SyncError when the server refused or failed
    (its outcome says how many buckets it took: a partial server must not be resumed)."""
    if bucket_mb <= 0:
        raise ValidationError("bucket_mb must be > 0")
    t0 = time.perf_counter()
    src = sources.open_source(named_tensors)
    out = ServerOutcome(client.url)
    version = version_str(weight_version)
    result = SyncResult(version, "tensor", sources.label_of(named_tensors, src), [out])
    try:
        src.specs()  # an unreadable source fails before the server is touched
        with ThreadPoolExecutor(1) as pool:
            try:
                info = client.server_info()
                out.old_version = out.weight_version = info.weight_version
                out.device, out.dtype, out.gpu_uuid = info.device, info.dtype, info.gpu_uuid
            except Exception as exc:
                out.fail("connect", exc)
            if out.ok:
                try:
                    check_covers(client, src)
                except Exception as exc:
                    out.fail("plan", exc)
            if out.ok:
                try:
                    device = devices.stage_device(out.device, stage_device, out.gpu_uuid)
                    served, budget = dtype_of(out.dtype), int(bucket_mb * staging.MiB)
                    plans = sources.plans_of(src, served, budget, device)
                    result.num_buckets = len(plans)
                    result.num_bytes = sum(p.nbytes for p in plans)
                    opts = PushOptions(version, token_step, flush_at_end=flush_cache)
                    push_buckets(src, plans, device, [Target(client, out)], pool, opts)
                except KeyboardInterrupt:
                    raise
                except Exception as exc:
                    out.fail("push", exc)
    except KeyboardInterrupt as exc:
        result.interrupted_by = stopped_by(exc)
        raise SyncInterrupted(result) from exc
    finally:
        if src is not named_tensors:
            src.close()
    result.timings["push"] = out.timings["push"] = round(time.perf_counter() - t0, 4)
    if not out.ok:
        raise SyncError(result)
    if out.num_buckets == result.num_buckets:
        out.weight_version = version if version is not None else out.weight_version
    return result
