"""The tensor push: stage bucket i+1 while bucket i is in flight to every server, then free i.

At most two buckets are alive at once: the one the servers are reading and the one being
staged. A bucket is freed only after every call that carries it has returned (the servers read
its memory during the call), even when staging or a call fails. A server whose call fails is
dropped from later buckets and named with the bucket it failed on; the others go on.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from grctl.client.calls import body_never_read
from grctl.client.devices import release_unclaimed
from grctl.client.http import ClientTimeout, GRClient
from grctl.client.outcome import ServerOutcome
from grctl.client.staging import BucketPlan, BufferPool, StagedBucket, stage
from grctl.weights.checkpoint import Checkpoint


@dataclass
class Target:
    client: GRClient
    outcome: ServerOutcome


@dataclass
class PushOptions:
    weight_version: str | None
    token_step: int | str | None
    flush_at_end: bool = True  # the last bucket flushes the prefill cache; the others do not


InFlight = tuple[StagedBucket, list[tuple[Target, Future]]]


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
    the servers that took it."""
    bucket, calls = flight
    try:
        wait([future for _, future in calls])
    finally:
        bucket.free()
    took = []
    for target, future in calls:
        out = target.outcome
        exc = future.exception()
        if exc is None:
            reply = future.result()
            out.num_buckets += 1
            out.num_bytes += bucket.nbytes
            out.num_tensors += reply.tensors_loaded
            took.append(target)
        else:
            out.fail("push", exc, where=f"bucket {bucket.plan.index + 1}/{num_buckets}")
    return took


def push_buckets(
    ckpt: Checkpoint,
    plans: list[BucketPlan],
    device: torch.device,
    targets: list[Target],
    pool: ThreadPoolExecutor,
    opts: PushOptions,
    on_bucket: Callable[[BucketPlan], None] | None = None,
) -> None:
    """Push every planned bucket to every target; failures land in the targets' outcomes.
    An error while staging (an unreadable checkpoint) is raised after the in-flight bucket has
    been settled and freed."""
    alive = list(targets)
    flight: InFlight | None = None
    # the bucket in flight and the one being staged: two buffers, reused by every bucket
    buffers = None
    if plans:
        buffers = BufferPool(max(p.nbytes for p in plans), device, min(2, len(plans)))
    try:
        for plan in plans:
            if not alive:
                break
            bucket = stage(ckpt, plan, device, buffers)  # overlaps with the previous bucket's calls
            if flight is not None:
                previous, flight = flight, None
                alive = settle(previous, len(plans))
                if on_bucket:
                    on_bucket(previous[0].plan)
                if not alive:
                    bucket.free()
                    break
            is_last = plan.index == len(plans) - 1
            calls = [(t, pool.submit(send, t, bucket, opts, is_last)) for t in alive]
            flight = (bucket, calls)
        if flight is not None:
            previous, flight = flight, None
            settle(previous, len(plans))
            if on_bucket:
                on_bucket(previous[0].plan)
    finally:
        if flight is not None:  # staging failed while a bucket was in flight
            settle(flight, len(plans))
