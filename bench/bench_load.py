"""Start-up load of a ~1 GiB bf16 checkpoint into a built model, beside a memcpy of the same bytes.

python bench/bench_load.py [--dir /tmp/grctl-bench-1g]   -> one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    ONE_GIB_CONFIG,
    PeakRss,
    memcpy_seconds,
    read_through,
    write_random_checkpoint,
)
from grctl.weights.checkpoint import Checkpoint  # noqa: E402
from grctl.weights.loader import empty_model, load_checkpoint_into  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/grctl-bench-1g")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = Path(args.dir)
    if not (path / "config.json").exists():
        write_random_checkpoint(path, ONE_GIB_CONFIG)
    nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    read_through(path)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = empty_model(ONE_GIB_CONFIG, torch.device("cpu"), torch.bfloat16)
    params = [p.data for p in model.parameters()]
    for p in params:
        p.zero_()  # touch every page: we measure the load, not first-touch faults
    times, growth = [], []
    for _ in range(args.repeats):
        with PeakRss() as rss:
            t0 = time.perf_counter()
            with Checkpoint(path) as ckpt:
                n = load_checkpoint_into(model, ckpt)
            times.append(time.perf_counter() - t0)
        growth.append(rss.growth)
    memcpy = memcpy_seconds(params, args.repeats)
    load = min(times)
    print(
        json.dumps(
            {
                "bench": "load",
                "checkpoint_bytes": nbytes,
                "tensors": n,
                "load_s": round(load, 4),
                "load_gbps": round(nbytes / load / 1e9, 2),
                "memcpy_s": round(memcpy, 4),
                "memcpy_gbps": round(nbytes / memcpy / 1e9, 2),
                "ratio_vs_memcpy": round(load / memcpy, 2),
                "rss_anon_growth_bytes": max(growth),
                "rss_anon_growth_frac": round(max(growth) / nbytes, 4),
                "targets": {"ratio_vs_memcpy": 1.5, "rss_anon_growth_frac": 0.10},
            }
        )
    )


if __name__ == "__main__":
    main()
