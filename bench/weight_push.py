"""The client side of bench_weight_sync's tensor part, run as its own process.

    python -m bench.weight_push URL CKPT [--version V] [--bucket-mb 512] [--sync-run]

Pushes the checkpoint with the client library's pieces (plan_buckets, stage into POSIX shared
memory, one update_weights_from_tensor call per bucket: flattened_bucket, flush_cache false, a
weight_version), one bucket at a time so that staging and the update calls are timed apart; or,
with --sync-run, through WeightSync.run (the product path: staging bucket i+1 overlaps the call
carrying bucket i). Then a few tensors are read back and compared with the checkpoint. Prints one
JSON object on stdout.
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
from grctl.client.staging import MiB, plan_buckets, stage  # noqa: E402
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
        client.pause_generation()
        client.flush_cache()
        pause_flush_s = time.perf_counter() - t0
        stage_s = calls_s = server_ms = 0.0
        num_tensors = 0
        for plan in plans:
            t0 = time.perf_counter()
            bucket = stage(ckpt, plan, torch.device("cpu"))
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
        "stage_s": round(stage_s, 4),
        "calls_wall_s": round(calls_s, 4),
        "calls_server_s": round(server_ms / 1e3, 4),
        "pause_flush_s": round(pause_flush_s, 4),
        "continue_s": round(continue_s, 4),
        "weight_version": client.get_weight_version().weight_version,
        "read_back_mismatches": mismatched,
    }


def sync_run(url: str, path: Path, version: str, bucket_mb: float) -> dict:
    from grctl.client import WeightSync

    with WeightSync(url, bucket_mb=bucket_mb) as sync:
        result = sync.run(path, weight_version=version)
    with GRClient(url) as client, Checkpoint(path) as ckpt:
        mismatched = reads_back(client, ckpt)
    return {
        "checkpoint": path.name,
        "num_buckets": result.num_buckets,
        "num_bytes": result.num_bytes,
        "timings_s": result.timings,
        "weight_version": result.servers[0].weight_version,
        "read_back_mismatches": mismatched,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--version", default="pushed")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--sync-run", action="store_true", help="push through WeightSync.run")
    args = ap.parse_args()
    if args.sync_run:
        out = sync_run(args.url, args.checkpoint, args.version, args.bucket_mb)
    else:
        with GRClient(args.url) as client:
            out = push(client, args.checkpoint, args.version, int(args.bucket_mb * MiB))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
