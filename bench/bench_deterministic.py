"""The throughput cost of --enable-deterministic-inference on a mixed rollout, beside the plain
kernels in the same run.

    python bench/bench_deterministic.py [--preset cpu|gpu] [--prompts 24] [--min-len 64]
        [--max-len 512] [--new-tokens 3] [--repeats 3] [--threads N]

bench_generate.py's model (preset cpu: the 29M Qwen3 in float32; gpu: Qwen3-0.6B's shape in
bf16 on CUDA), in process. A rollout: --prompts prompts of lengths uniform in [min, max], beam
widths cycling 1, 4, 8, 2, 16, greedy and seeded stochastic alternating, every request with
logprobs, submitted together (one engine batch), the prefix cache cleared before each run. The
two modes run alternately, --repeats times each; the best wall time of each counts, beside the
medians and the median of each alternation's own ratio (the pair ran back to back, so a load
that moves both moves it least). Prints one JSON object: tokens/s of each mode, the throughput
ratio (deterministic / plain) best, median and paired, the cost (1 - the best ratio), the load
average, and whether every deterministic run gave the same bits (it must) and how many requests
the plain runs changed between them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_generate import PRESETS, build  # noqa: E402
from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.engine import Engine  # noqa: E402
from grctl.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from grctl.model import dtypes  # noqa: E402

WIDTHS = (1, 4, 8, 2, 16)


def rollout(args, vocab: int) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=gen)
    return [
        GenerateRequest(
            tuple(torch.randint(0, vocab, (int(n),), generator=gen).tolist()),
            SamplingParams(
                max_new_tokens=args.new_tokens,
                n=WIDTHS[i % len(WIDTHS)],
                temperature=1.0 if i % 2 else 0.0,
                seed=i,
                ignore_eos=True,
            ),
            return_logprob=True,
        )
        for i, n in enumerate(lens.tolist())
    ]


def run(engine: Engine, reqs: list[GenerateRequest]) -> tuple[float, list]:
    """Every request submitted, the engine stepped in this thread until idle."""
    engine.cache.clear()
    t0 = time.perf_counter()
    rids = [engine.submit(r) for r in reqs]
    while engine.run_step():
        pass
    results = [engine.result(r) for r in rids]
    wall = time.perf_counter() - t0
    return wall, [[(b.output_ids, b.output_token_logprobs) for b in r.beams] for r in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    preset = PRESETS[args.preset]
    _, model = build(preset["shape"], dtypes.SERVED_DTYPES[preset["dtype"]], preset["device"])
    reqs = rollout(args, model.config.vocab_size)
    tokens = sum(len(r.input_ids) + r.sampling.width * args.new_tokens for r in reqs)
    engines = {
        mode: Engine(
            model,
            EngineConfig(
                device=preset["device"],
                max_new_tokens=args.new_tokens,
                deterministic_inference=mode == "deterministic",
            ),
        )
        for mode in ("plain", "deterministic")
    }
    walls: dict[str, list[float]] = {m: [] for m in engines}
    outs: dict[str, list] = {m: [] for m in engines}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            engine.model.set_batch_invariant(mode == "deterministic")  # one model, two engines
            wall, out = run(engine, reqs)
            walls[mode].append(wall)
            outs[mode].append(out)
    best = {m: min(w) for m, w in walls.items()}
    median = {m: statistics.median(w) for m, w in walls.items()}
    pairs = [p / d for p, d in zip(walls["plain"], walls["deterministic"], strict=True)]
    plain_changed = sum(a != b for a, b in zip(outs["plain"][0], outs["plain"][-1], strict=True))
    print(
        json.dumps(
            {
                "preset": args.preset,
                "device": preset["device"],
                "threads": torch.get_num_threads(),
                "prompts": args.prompts,
                "lengths": [args.min_len, args.max_len],
                "widths": list(WIDTHS),
                "new_tokens": args.new_tokens,
                "tokens": tokens,
                "wall_s": {m: [round(w, 3) for w in ws] for m, ws in walls.items()},
                "tokens_per_s": {m: round(tokens / b, 1) for m, b in best.items()},
                "throughput_ratio": {
                    "best": round(best["plain"] / best["deterministic"], 3),
                    "median": round(median["plain"] / median["deterministic"], 3),
                    "paired_median": round(statistics.median(pairs), 3),
                },
                "cost": round(1 - best["plain"] / best["deterministic"], 4),
                "load_average": {
                    "start": [round(x, 2) for x in load_start],
                    "end": [round(x, 2) for x in os.getloadavg()],
                },
                "deterministic_runs_identical": all(
                    o == outs["deterministic"][0] for o in outs["deterministic"]
                ),
                "plain_requests_changed_between_runs": plain_changed,
            }
        )
    )


if __name__ == "__main__":
    main()
