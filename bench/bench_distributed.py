"""Full-model broadcast of a ~1 GiB bf16 checkpoint over gloo to one and two `grctl serve`
processes on this machine, beside a memcpy of the same bytes.

python bench/bench_distributed.py [--dir /tmp/grctl-bench-1g]   -> one JSON object on stdout

Each figure is the trainer's wall time for WeightBroadcaster.send: every bucket broadcast, and
every server's update call answered (received, validated, copied in place). The group is made
once per fleet, outside the timing, as a trainer does once per run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ONE_GIB_CONFIG, memcpy_seconds, write_random_checkpoint  # noqa: E402
from grctl.client.distributed import DEFAULT_BUCKET_BYTES, WeightBroadcaster  # noqa: E402
from tests.support.serverproc import running_server  # noqa: E402


def load_state(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def time_send(urls: list[str], state: dict, load_format: str | None, repeats: int) -> dict:
    with WeightBroadcaster(urls, load_format=load_format, timeout_s=600) as wb:
        runs = [wb.send(state.items(), weight_version=f"bench-{i}") for i in range(repeats)]
    best = min(runs, key=lambda r: r["s"])
    return {"s": round(best["s"], 4), "buckets": best["buckets"], "bytes": best["bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/grctl-bench-1g")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-servers", type=int, default=2)
    args = ap.parse_args()
    path = Path(args.dir)
    if not (path / "config.json").exists():
        write_random_checkpoint(path, ONE_GIB_CONFIG)
    state = load_state(path)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    dst = [torch.empty_like(t) for t in state.values()]
    memcpy = memcpy_seconds(dst, args.repeats)
    results = []
    with ExitStack() as stack:
        urls: list[str] = []
        for num_servers in range(1, args.max_servers + 1):
            srv = running_server(
                "--allow-weight-update", "--model-path", str(path), start_timeout=300
            )
            urls.append(stack.enter_context(srv).url)
            for load_format in ("flattened_bucket", None):
                t = time_send(urls, state, load_format, args.repeats)
                results.append(
                    {
                        "servers": num_servers,
                        "load_format": load_format or "per_tensor",
                        "broadcast_s": t["s"],
                        "buckets": t["buckets"],
                        "gbps_per_server": round(nbytes / t["s"] / 1e9, 3),
                    }
                )
    memcpy = min(memcpy, memcpy_seconds(dst, args.repeats))  # again: the machine may be shared
    for r in results:
        r["ratio_vs_memcpy"] = round(r["broadcast_s"] / memcpy, 2)
    print(
        json.dumps(
            {
                "bench": "distributed_gloo_cpu",
                "model_bytes": nbytes,
                "tensors": len(state),
                "bucket_bytes": DEFAULT_BUCKET_BYTES,
                "torch_threads": torch.get_num_threads(),
                "memcpy_s": round(memcpy, 4),
                "memcpy_gbps": round(nbytes / memcpy / 1e9, 2),
                "runs": results,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
        )
    )


if __name__ == "__main__":
    main()
