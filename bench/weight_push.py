"""The client side of bench_weight_sync's tensor and sync parts, run as its own process.

    python -m bench.weight_push URL CKPT [--version V] [--bucket-mb 512]
    python -m bench.weight_push URL CKPT --sync-run [--transport auto|tensor] [--repeats N]
                                         [--alt CKPT_B]
    python -m bench.weight_push URL CKPT --arena [--repeats N] [--alt CKPT_B]

Default: the client library's pieces one bucket at a time (plan_buckets, stage into the
process's pre-faulted shared-memory pool, one update_weights_from_tensor call per bucket:
flattened_bucket, flush_cache false, a weight_version), so staging and the update calls are
timed apart; making the pool (fresh pages faulted in once per process) is timed on its own.
--sync-run: WeightSync.run, the product path (`grctl push`), `--repeats` times in this one
process, alternating CKPT and --alt: the first run is a fresh process's, the later ones the
steady state. --arena: the checkpoint read once into a grctl.rl Arena (a trainer's weights in
shared memory), then WeightSync.run of the arena `--repeats` times (its tensors change between
runs: CKPT, then --alt, copied into the arena's views outside the timed window). Each run
reports its stages and `pause_to_continue_s` (pause, flush, push, continue, verify). A few
tensors are read back and compared with the checkpoint after each. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grctl.client import GRClient  # noqa: E402
from grctl.client.staging import BufferPool, MiB, plan_buckets, stage  # noqa: E402
from grctl.client.verify import dtype_of  # noqa: E402
from grctl.weights.checkpoint import Checkpoint  # noqa: E402

# HF names read back after a push: whole tensors, fused q/k/v and gate/up shards, first and last
# layer, the untied head.
READ_BACK = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.15.mlp.down_proj.weight",
    "model.layers.15.self_attn.k_norm.weight",
    "model.norm.weight",
    "lm_head.weight",
)
READ_BACK_ROWS = 2


def reads_back(client: GRClient, ckpt: Checkpoint, names=READ_BACK) -> list[str]:
    """The names whose first rows on the server differ from the checkpoint's (empty: all equal)."""
    ckpt.specs()
    bad = []
    for name in names:
        served = client.get_weights_by_name(name, truncate_size=READ_BACK_ROWS).parameter
        expected = ckpt.fetch(name)[:READ_BACK_ROWS].float().tolist()
        if served != expected:
            bad.append(name)
    return bad


def push(client: GRClient, path: Path, version: str, bucket_bytes: int) -> dict:
    """One model pushed bucket by bucket; staging and the update calls timed apart."""
    with Checkpoint(path) as ckpt:
        served = dtype_of(client.server_info().dtype)
        plans = plan_buckets(ckpt.specs(), served, bucket_bytes)
        t0 = time.perf_counter()
        pool = BufferPool(max(p.nbytes for p in plans), torch.device("cpu"), 1)
        pool_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        client.pause_generation()
        client.flush_cache()
        pause_flush_s = time.perf_counter() - t0
        stage_s = calls_s = server_ms = 0.0
        num_tensors = 0
        for plan in plans:
            t0 = time.perf_counter()
            bucket = stage(ckpt, plan, torch.device("cpu"), pool)
            t1 = time.perf_counter()
            reply = client.update_weights_from_tensor(
                [bucket.payload()],
                load_format="flattened_bucket",
                weight_version=version,
                flush_cache=False,
            )
            t2 = time.perf_counter()
            bucket.free()
            stage_s += t1 - t0
            calls_s += t2 - t1
            server_ms += reply.elapsed_ms
            num_tensors += reply.tensors_loaded
        t0 = time.perf_counter()
        client.continue_generation()
        continue_s = time.perf_counter() - t0
        mismatched = reads_back(client, ckpt)
    return {
        "checkpoint": path.name,
        "num_buckets": len(plans),
        "num_bytes": sum(p.nbytes for p in plans),
        "num_tensors": num_tensors,
        "pool_s": round(pool_s, 4),
        "stage_s": round(stage_s, 4),
        "calls_wall_s": round(calls_s, 4),
        "calls_server_s": round(server_ms / 1e3, 4),
        "pause_flush_s": round(pause_flush_s, 4),
        "continue_s": round(continue_s, 4),
        "weight_version": client.get_weight_version().weight_version,
        "read_back_mismatches": mismatched,
    }


WINDOW = ("pause", "flush", "push", "continue", "verify")


def one_run(sync, source, path: Path, version: str, url: str) -> dict:
    result = sync.run(source, weight_version=version)
    with GRClient(url) as client, Checkpoint(path) as ckpt:
        mismatched = reads_back(client, ckpt)
    return {
        "checkpoint": path.name,
        "transport": result.transport,
        "num_buckets": result.num_buckets,
        "num_bytes": result.num_bytes,
        "timings_s": result.timings,
        "pause_to_continue_s": round(sum(result.timings.get(k, 0.0) for k in WINDOW), 4),
        "weight_version": result.servers[0].weight_version,
        "read_back_mismatches": mismatched,
    }


def sync_runs(url: str, paths: list[Path], version: str, args) -> dict:
    """WeightSync.run `args.repeats` times in this process (the first: a fresh process's)."""
    from grctl.client import WeightSync

    kw = {"bucket_mb": args.bucket_mb} if args.transport == "tensor" else {}
    started = time.perf_counter()
    runs = []
    with WeightSync(url, transport=args.transport, **kw) as sync:
        for i in range(args.repeats):
            path = paths[i % len(paths)]
            runs.append(one_run(sync, str(path), path, f"{version}-{i}", url))
    return {"mode": "sync_run", "transport": args.transport, "runs": runs,
            "process_s": round(time.perf_counter() - started, 4)}  # fmt: skip


def arena_runs(url: str, paths: list[Path], version: str, args) -> dict:
    """An arena holding the checkpoint (read once), pushed `args.repeats` times."""
    from grctl.client import WeightSync
    from grctl.rl.arena import Arena

    with Checkpoint(paths[0]) as ckpt:
        t0 = time.perf_counter()
        arena = Arena(ckpt.iter_tensors())
        arena_s = time.perf_counter() - t0
    views, runs = arena.tensors(), []
    with WeightSync(url) as sync:
        for i in range(args.repeats):
            path = paths[i % len(paths)]
            if i and len(paths) > 1:  # the trainer's step: new values in the same views
                with Checkpoint(path) as ckpt:
                    for name, tensor in ckpt.iter_tensors():
                        views[name].copy_(tensor)
            runs.append(one_run(sync, arena, path, f"{version}-{i}", url))
    return {"mode": "arena", "arena_bytes": arena.nbytes, "arena_make_s": round(arena_s, 4),
            "runs": runs}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--alt", type=Path, help="a second checkpoint, alternated with the first")
    ap.add_argument("--version", default="pushed")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--sync-run", action="store_true", help="push through WeightSync.run")
    ap.add_argument("--arena", action="store_true", help="WeightSync.run of an Arena")
    ap.add_argument("--transport", choices=("auto", "tensor"), default="auto")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    paths = [args.checkpoint] + ([args.alt] if args.alt else [])
    if args.sync_run:
        out = sync_runs(args.url, paths, args.version, args)
    elif args.arena:
        out = arena_runs(args.url, paths, args.version, args)
    else:
        with GRClient(args.url) as client:
            out = push(client, args.checkpoint, args.version, int(args.bucket_mb * MiB))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
