"""Reason, then recommend: one multi-stage /generate against the same work driven as verl-GR
drives it, against the same `grctl serve`, in one run.

    python bench/bench_two_stage.py [--prompts 4] [--prompt-len 64] [--reasoning 16]
        [--width 16] [--item-tokens 4] [--parallelism 8] [--repeats 2]

The server is a real subprocess on the built-in model (CPU). Driven (verl-GR's
two_stage_vllm_async.py): per prompt a sampling call of the reasoning, then the item beams
searched from Python, one /generate of max_new_tokens 1 with top_logprobs_num 2 x width per beam
per step, --parallelism calls at a time (verl-GR's beam_subrequest_parallelism), the width best
continuations kept by cumulative logprob. Multi-stage: one /generate of every prompt (a batch),
sampling_params.reasoning + forced_prefix + width free beams. The two take turns, best of
--repeats. Prints one JSON object: each one's wall seconds and HTTP calls, the ratio (target: at
least 5), and the multi-stage reply's cached_tokens per group (what its item stage did not
prefill again).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.serverproc import running_server  # noqa: E402

TARGET = 5.0
PREFIX = [3, 5]


def prompt(i: int, length: int) -> list[int]:
    return [(i * 7919 + t * 31) % 200 + 10 for t in range(length)]


def driven(clients, args, prompts) -> tuple[float, int]:
    """verl-GR's way: a sampling call, then one-token calls per beam per step."""
    calls = 0
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(args.parallelism)

    def one(ctx: list[int], k: int, *, sp: dict) -> dict:
        http = clients[k % len(clients)]
        body = {"input_ids": ctx, "sampling_params": sp, "return_logprob": True}
        if sp["max_new_tokens"] == 1:
            body["top_logprobs_num"] = 2 * args.width
        r = http.post("/generate", json=body)
        r.raise_for_status()
        return r.json()

    for i, p in enumerate(prompts):
        sp1 = {
            "max_new_tokens": args.reasoning,
            "temperature": 1.0,
            "seed": i,
            "use_catalog": False,
            "ignore_eos": True,
        }
        reasoning = one(p, 0, sp=sp1)["output_ids"]
        calls += 1
        beams = [([], 0.0)]
        ctx0 = p + reasoning + PREFIX
        for _ in range(args.item_tokens):
            sp = {"max_new_tokens": 1, "use_catalog": False}
            outs = list(
                pool.map(
                    lambda kb, ctx0=ctx0, sp=sp: one(ctx0 + kb[1][0], kb[0], sp=sp),
                    enumerate(beams),
                )
            )
            calls += len(beams)
            cands = []
            for (toks, score), out in zip(beams, outs, strict=True):
                for lp, tok, _ in out["meta_info"]["output_top_logprobs"][0]:
                    cands.append((toks + [tok], score + lp))
            cands.sort(key=lambda c: -c[1])
            beams = cands[: args.width]
    pool.shutdown()
    return time.perf_counter() - t0, calls


def staged(http, args, prompts, seed: int = 0) -> tuple[float, dict]:
    sp = {
        "reasoning": {
            "max_new_tokens": args.reasoning,
            "temperature": 1.0,
            "seed": seed,
            "ignore_eos": True,
        },
        "forced_prefix": {"ids": PREFIX},
        "n": args.width,
        "max_new_tokens": args.item_tokens,
        "use_catalog": False,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    r = http.post(
        "/generate", json={"input_ids": prompts, "sampling_params": sp, "return_logprob": True}
    )
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reasoning", type=int, default=16)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--item-tokens", type=int, default=4)
    ap.add_argument("--parallelism", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    prompts = [prompt(i, args.prompt_len) for i in range(args.prompts)]
    with running_server("--max-new-tokens", "256") as srv:
        clients = [srv.client(timeout=300) for _ in range(args.parallelism)]
        try:
            staged(clients[0], args, prompts)  # warm-up, both paths
            driven(clients, args, prompts[:1])
            best_d, best_s, calls, reply = float("inf"), float("inf"), 0, None
            for rep in range(args.repeats):
                d, calls = driven(clients, args, prompts)
                s, reply = staged(clients[0], args, prompts, seed=1000 * (rep + 1))
                best_d, best_s = min(best_d, d), min(best_s, s)
        finally:
            for c in clients:
                c.close()
    groups = [g for one in reply for g in one["meta_info"]["stage_groups"]]
    print(
        json.dumps(
            {
                "model": "built-in (CPU)",
                "args": vars(args),
                "driven_s": round(best_d, 3),
                "driven_http_calls": calls,
                "multi_stage_s": round(best_s, 3),
                "multi_stage_http_calls": 1,
                "speedup": round(best_d / best_s, 2),
                "target": TARGET,
                "meets_target": best_d / best_s >= TARGET,
                "prompt_tokens": args.prompt_len,
                "reasoning_tokens": args.reasoning,
                "item_stage_cached_tokens": [g["cached_tokens"] for g in groups],
                "beams_per_group": [g["num_beams"] for g in groups],
                "load_average": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
