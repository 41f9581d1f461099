"""The tensor push: stage bucket i+1 while bucket i is in flight to every server, then free i.

At most two buckets are alive at once: the one the servers are reading and the one being
staged. A bucket is freed only after every call that carries it has returned (the servers read
its memory during the call), even when staging or a call fails. A server whose call fails is
dropped from later buckets and named with the bucket it failed on; the others go on. Each
outcome counts the buckets its server acknowledged, so a sync stopped part-way knows which
servers are partly updated.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from grctl.client import buffers
from grctl.client.calls import ClientTimeout, body_never_read
from grctl.client.devices import release_unclaimed
from grctl.client.outcome import ServerOutcome
from grctl.client.routes import Routes
from grctl.client.staging import BucketPlan, StagedBucket, stage
from grctl.errors import GrctlError


@dataclass
class Target:
    client: Routes  # a GRClient
    outcome: ServerOutcome


@dataclass
class PushOptions:
    weight_version: str | None
    token_step: int | str | None
    flush_at_end: bool = True  # the last bucket flushes the prefill cache; the others do not


# How long an interrupted push waits for the calls already in flight, so it knows whether the
# bucket they carry was applied (a second Ctrl-C stops the wait).
SETTLE_ON_INTERRUPT_S = 30.0


@dataclass
class InFlight:
    bucket: StagedBucket
    calls: list[tuple[Target, Future]] = field(default_factory=list)
    is_settled: bool = False


def send(target: Target, bucket: StagedBucket, opts: PushOptions, is_last: bool):
    payload, shares = bucket.payload_and_shares()  # fresh per server (see StagedBucket.payload)
    try:
        return target.client.update_weights_from_tensor(
            [payload],
            load_format="flattened_bucket",
            weight_version=opts.weight_version,
            token_step=opts.token_step,
            flush_cache=opts.flush_at_end and is_last,
        )
    except Exception as exc:
        if body_never_read(exc):  # refused before any rebuild: nobody else drops these
            shares.release_segments()
        if isinstance(exc, ClientTimeout):  # the server may still be reading the bucket
            shares.counters = []
        raise
    finally:
        if shares.counters:  # a CUDA bucket the server refused before rebuilding it
            release_unclaimed(shares.counters)


def settle(flight: InFlight, num_buckets: int) -> list[Target]:
    """Wait for every call carrying the bucket, record each outcome, free the bucket; returns
    the servers that took it. Interrupted, it waits a while more for the calls to return (their
    replies say whether the bucket was applied); a call still out is marked uncertain."""
    futures = [future for _, future in flight.calls]
    try:
        wait(futures)
    except BaseException:
        try:
            wait(futures, timeout=SETTLE_ON_INTERRUPT_S)
        finally:
            record(flight, num_buckets)
        raise
    return record(flight, num_buckets)


def record(flight: InFlight, num_buckets: int) -> list[Target]:
    if flight.is_settled:
        return []
    flight.is_settled = True
    took = []
    for target, future in flight.calls:
        out = target.outcome
        if not future.done():  # no reply yet: the server may or may not apply it
            out.uncertain = True
            continue
        exc = future.exception()
        if exc is None:
            reply = future.result()
            out.num_buckets += 1
            out.num_bytes += flight.bucket.nbytes
            out.num_tensors += reply.tensors_loaded
            took.append(target)
        else:
            out.uncertain = out.uncertain or not is_refusal(exc)
            where = f"bucket {flight.bucket.plan.index + 1}/{num_buckets}"
            out.fail("push", exc, where=where)
    if all(future.done() for _, future in flight.calls):
        flight.bucket.free()  # else the pending call keeps it alive until it returns
    return took


def is_refusal(exc: BaseException) -> bool:
    """The server answered with an error: it applied nothing of that chunk (validate first).
    A 500 is a copy that failed part-way (the server then refuses to serve until fixed)."""
    status = getattr(exc, "status", 0)
    return isinstance(exc, GrctlError) and 400 <= status < 500


def push_buckets(
    source,
    plans: list[BucketPlan],
    device: torch.device,
    targets: list[Target],
    workers: ThreadPoolExecutor,
    opts: PushOptions,
    on_bucket: Callable[[BucketPlan], None] | None = None,
) -> None:
    """Push every planned bucket of `source` (client.sources) to every target; failures land in
    the targets' outcomes. An error while staging (an unreadable checkpoint), or an interrupt,
    is raised after the bucket in flight has been settled: each outcome then counts exactly the
    buckets applied."""
    alive = list(targets)
    for t in targets:
        t.outcome.buckets_total = len(plans)
    if not plans:
        return
    # the bucket in flight and the one being staged: two buffers, kept for the process's
    # later pushes (client.buffers)
    in_place = getattr(source, "bucket_view", None)
    if callable(in_place) and all(_lies_on(in_place(p), device) for p in plans):
        _push_planned(source, plans, device, alive, None, workers, opts, on_bucket)
        return
    count = min(2, len(plans))
    with buffers.pool_for(max(p.nbytes for p in plans), device, count) as pool:
        _push_planned(source, plans, device, alive, pool, workers, opts, on_bucket)


def _lies_on(flat: torch.Tensor | None, device: torch.device) -> bool:
    return flat is not None and flat.device == device


def _push_planned(source, plans, device, alive, pool, workers, opts, on_bucket) -> None:
    flight: InFlight | None = None
    try:
        for plan in plans:
            if not alive:
                break
            # overlaps with the calls carrying the previous bucket
            bucket = stage(source, plan, device, pool)
            if flight is not None:
                alive = settle(flight, len(plans))
                if on_bucket:
                    on_bucket(flight.bucket.plan)
                flight = None
                if not alive:
                    bucket.free()
                    break
            is_last = plan.index == len(plans) - 1
            flight = InFlight(bucket)
            for t in alive:
                flight.calls.append((t, workers.submit(send, t, bucket, opts, is_last)))
        if flight is not None:
            settle(flight, len(plans))
            if on_bucket:
                on_bucket(flight.bucket.plan)
            flight = None
    finally:
        if flight is not None and not flight.is_settled:  # staging failed, or an interrupt
            settle(flight, len(plans))
