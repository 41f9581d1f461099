"""The search's cost: stochastic beams against deterministic ones, and beam selection's share of
a decode step at many requests (one set of ops per step for all requests).

On the built-in GR model (the engine directly, no HTTP): `beam64` runs one prompt with beam 64,
deterministic (T = 0) and stochastic (T = 1, Gumbel top-k without replacement), alternating, best
of N and the median; `select` decodes R requests together and times, per decode step, the model
(runner.decode) and the selection (beam_select.step) of all of them; `select_synthetic` times
the selection alone on random logits (no model: the figure least moved by a loaded machine, best
of --repeats searches, one torch thread). Prints one JSON object.

    python bench/bench_search.py [--repeats 5] [--requests 128] [--width 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.engine import Engine  # noqa: E402
from grctl.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from grctl.engine.search import beam_select  # noqa: E402
from grctl.engine.search.beam import Beams  # noqa: E402
from grctl.weights.loader import load_model  # noqa: E402


def run(eng: Engine, reqs: list[GenerateRequest]) -> float:
    t = time.perf_counter()
    rids = [eng.submit(r) for r in reqs]
    while eng.run_step():
        pass
    for r in rids:
        eng.result(r)
    return time.perf_counter() - t


def beam64(eng: Engine, repeats: int, prompt_len: int, new_tokens: int) -> dict:
    prompt = tuple(range(10, 10 + prompt_len))
    kinds = {
        "deterministic": SamplingParams(n=64, max_new_tokens=new_tokens, ignore_eos=True),
        "stochastic": SamplingParams(
            n=64, max_new_tokens=new_tokens, temperature=1.0, seed=0, ignore_eos=True
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats + 1):  # the first round warms up
        for kind, sp in kinds.items():
            times[kind].append(run(eng, [GenerateRequest(prompt, sp)]))
    out = {
        k: {"best_s": min(v[1:]), "median_s": statistics.median(v[1:])} for k, v in times.items()
    }
    out["ratio_best"] = out["stochastic"]["best_s"] / out["deterministic"]["best_s"]
    out["ratio_median"] = out["stochastic"]["median_s"] / out["deterministic"]["median_s"]
    out.update(prompt_len=prompt_len, new_tokens=new_tokens, width=64)
    return out


def select_share(eng: Engine, num: int, width: int, new_tokens: int, stochastic: bool) -> dict:
    runner, timings = eng.runner, {"model": [], "select": []}
    decode, step = runner.decode, beam_select.step

    def timed(name, fn):
        def inner(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            timings[name].append(time.perf_counter() - t)
            return out

        return inner

    temp = 1.0 if stochastic else 0.0
    reqs = [
        GenerateRequest(
            tuple(range(5 + i % 7, 69 + i % 7)),
            SamplingParams(n=width, max_new_tokens=new_tokens, temperature=temp, seed=i),
        )
        for i in range(num)
    ]
    run(eng, reqs[:4])  # warm
    runner.decode, beam_select.step = timed("model", decode), timed("select", step)
    try:
        run(eng, reqs)
    finally:
        runner.decode, beam_select.step = decode, step
    # the prefill's selection runs before any decode: count decode steps only
    sel = timings["select"][-len(timings["model"]) :]
    model_s, select_s = sum(timings["model"]), sum(sel)
    return {
        "requests": num,
        "width": width,
        "stochastic": stochastic,
        "decode_steps": len(timings["model"]),
        "model_ms_per_step": 1e3 * model_s / len(timings["model"]),
        "select_ms_per_step": 1e3 * select_s / len(sel),
        "select_share_of_step": select_s / (select_s + model_s),
    }


def select_synthetic(num: int, width: int, repeats: int, vocab: int = 1024, steps: int = 5) -> dict:
    """beam_select.step alone for `num` requests of `width` beams on random logits [rows, vocab],
    ms per decode step (the prefill step left out), best of `repeats` searches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {"requests": num, "width": width, "vocab": vocab, "threads": 1}
    try:
        for temp in (0.0, 1.0):
            best = float("inf")
            for r in range(repeats):
                sp = [
                    SamplingParams(n=width, max_new_tokens=steps, temperature=temp, seed=i)
                    for i in range(num)
                ]
                beams = [Beams(p, (), vocab, torch.device("cpu")) for p in sp]
                gen = torch.Generator().manual_seed(r)
                total = 0.0
                for step in range(steps):
                    blocks, row = [], 0
                    for b in beams:
                        blocks.append(beam_select.Block(b, row, b.num_rows))
                        row += b.num_rows
                    logits = torch.randn(row, vocab, generator=gen) * 3
                    t = time.perf_counter()
                    beam_select.step(logits, blocks)
                    total += (time.perf_counter() - t) if step else 0.0
                best = min(best, total / (steps - 1))
            out["stochastic" if temp else "deterministic"] = {"select_ms_per_step": 1e3 * best}
    finally:
        torch.set_num_threads(threads)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(None, args.device)
    eng = Engine(model, EngineConfig(max_running_requests=args.requests, max_beam_width=64))
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "beam64": beam64(eng, args.repeats, args.prompt_len, args.new_tokens),
        "select": [
            select_share(eng, args.requests, args.width, 5, stochastic=False),
            select_share(eng, args.requests, args.width, 5, stochastic=True),
        ],
        "select_synthetic": select_synthetic(args.requests, max(args.width, 2), 5 * args.repeats),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
