"""Batch /generate (SGLang's list of prompts) against one request per prompt, over loopback HTTP.

    python bench/bench_batch.py [--prompts 32] [--prompt-len 256] [--repeats 3]

A real `grctl serve` on the built-in model (CPU unless --device). Three ways to get the same
replies: one /generate with every prompt in `input_ids`, the prompts one after another, and the
prompts from as many concurrent clients (the same-run reference a client without batch support
would use). Replies are checked equal across the three. Prints one JSON object: seconds (best
and median of the repeats) and prompts per second for each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.serverproc import running_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 1000, (args.prompts, args.prompt_len), generator=gen).tolist()
    sp = {"max_new_tokens": args.max_new_tokens}
    with running_server("--device", args.device, "--max-running-requests", "64") as srv:
        with httpx.Client(base_url=srv.url, timeout=600) as http:

            def one(prompt: list[int]) -> list[int]:
                body = {"input_ids": prompt, "sampling_params": sp}
                return http.post("/generate", json=body).json()["output_ids"]

            def batch() -> list[list[int]]:
                replies = http.post("/generate", json={"input_ids": prompts, "sampling_params": sp})
                return [r["output_ids"] for r in replies.json()]

            def sequential() -> list[list[int]]:
                return [one(p) for p in prompts]

            pool = ThreadPoolExecutor(args.prompts)

            def concurrent() -> list[list[int]]:
                return list(pool.map(one, prompts))

            ways = {"batch": batch, "sequential": sequential, "concurrent": concurrent}
            seconds: dict[str, list[float]] = {k: [] for k in ways}
            outputs = {}
            batch()  # warm-up
            for _ in range(args.repeats):
                for name, fn in ways.items():  # interleaved: each repeat runs all three
                    t0 = time.perf_counter()
                    outputs[name] = fn()
                    seconds[name].append(time.perf_counter() - t0)
            pool.shutdown()
    out = {"prompts": args.prompts, "prompt_len": args.prompt_len, "device": args.device}
    for name, xs in seconds.items():
        best = min(xs)
        out[name] = {
            "best_s": round(best, 4),
            "median_s": round(statistics.median(xs), 4),
            "prompts_per_s": round(args.prompts / best, 1),
        }
    out["replies_equal"] = outputs["batch"] == outputs["sequential"] == outputs["concurrent"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
