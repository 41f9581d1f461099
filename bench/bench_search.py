"""The search's cost: stochastic beams against deterministic ones, and beam selection's share of
a decode step at many requests (one set of ops per step for all requests).

On the built-in GR model (the engine directly, no HTTP): `beam64` runs one prompt with beam 64,
deterministic (T = 0) and stochastic (T = 1, Gumbel top-k without replacement), alternating, best
of N and the median; `select` decodes R requests together and times, per decode step, the model
(runner.decode) and the selection (beam_select.step) of all of them; `select_synthetic` times
the selection alone on random logits (no model: the figure least moved by a loaded machine, best
of --repeats searches, one torch thread). Prints one JSON object.

    python bench/bench_search.py [--repeats 5] [--requests 128] [--width 1] [--device cuda]
    python bench/bench_search.py --wide 2048 [--repeats 2] [--threads N]

`--wide PROMPT` measures only the anchors' widths (xLLM's beam 512 x top_k 512, 262,144
candidates a round): bench_generate.py's cpu model (29M Qwen3, vocab 8,192, fp32), one prompt of
PROMPT tokens at beam 1, 256, 512 and 1,024 (3 new tokens, ignore_eos: each beam ranks `width`
candidates, so beam 512 ranks 512 x 512 a round), interleaved, best of --repeats. Each width's
wall and CPU time (this process, all threads) over beam 1's beside its FLOP floor (bench/flops.py:
the ratio of the two requests' FLOPs), over beam 256's beside that floor, the selection's own
CPU ms per decode step (beam_select.step timed inside the run) and how many tokens of each row
the selection ranked at each decode step (search/row_budget.py); then the selection alone on
random logits at beam 512 and 1,024 (one thread, best of --repeats), with the row pruning and
with each row's own top K. On a loaded machine run it with --threads 1 and read the CPU times.
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
from bench.flops import request_flops  # noqa: E402
from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.engine import Engine  # noqa: E402
from grctl.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from grctl.engine.search import beam_select, candidates, row_budget  # noqa: E402
from grctl.engine.search.beam import Beams  # noqa: E402
from grctl.model import dtypes  # noqa: E402
from grctl.weights.loader import load_model  # noqa: E402

WIDE = (1, 256, 512, 1024)


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


def select_synthetic(
    num: int, width: int, repeats: int, vocab: int = 1024, steps: int = 5, temps=(0.0, 1.0)
) -> dict:
    """beam_select.step alone for `num` requests of `width` beams on random logits [rows, vocab],
    ms per decode step (the prefill step left out), best of `repeats` searches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {"requests": num, "width": width, "vocab": vocab, "threads": 1}
    try:
        for temp in temps:
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


def wide(prompt_len: int, repeats: int, new_tokens: int = 3) -> dict:
    """The anchors' widths at one prompt, beside the FLOP floor and beam 256, in one run."""
    preset = PRESETS["cpu"]
    _, model = build(preset["shape"], dtypes.SERVED_DTYPES[preset["dtype"]], "cpu")
    cfg = model.config
    eng = Engine(model, EngineConfig(max_beam_width=max(WIDE), max_new_tokens=new_tokens))
    gen = torch.Generator().manual_seed(2)
    prompt = tuple(torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist())
    step, top, sel, ranked = beam_select.step, candidates.row_top, [], []

    def timed(logits, blocks):
        t = time.process_time()
        step(logits, blocks)
        sel.append((sum(b.num_rows for b in blocks), time.process_time() - t))

    def counted(xr, *args):
        values, cols = top(xr, *args)
        ranked.append((xr.shape[0], values.shape[1]))
        return values, cols

    wall: dict[int, list[float]] = {w: [] for w in WIDE}
    cpu: dict[int, list[float]] = {w: [] for w in WIDE}
    select_ms: dict[int, list[float]] = {w: [] for w in WIDE}
    per_row: dict[int, list[int]] = {w: [] for w in WIDE}
    beam_select.step, candidates.row_top = timed, counted
    try:
        for _ in range(repeats):
            for w in WIDE:
                sp = SamplingParams(n=w, max_new_tokens=new_tokens, ignore_eos=True)
                eng.cache.clear()
                sel.clear()
                ranked.clear()
                c = time.process_time()
                wall[w].append(run(eng, [GenerateRequest(prompt, sp)]))
                cpu[w].append(time.process_time() - c)
                decode = [s for rows, s in sel if rows == w]  # the decode steps' selections
                select_ms[w].append(1e3 * statistics.mean(decode) if decode else 0.0)
                per_row[w] = [kk for rows, kk in ranked if rows == w]
    finally:
        beam_select.step, candidates.row_top = step, top
    flops = {w: request_flops(cfg, prompt_len, w, new_tokens) for w in WIDE}
    out: dict = {"prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats}
    for w in WIDE[1:]:
        floor_1, floor_256 = flops[w] / flops[1], flops[w] / flops[256]
        entry: dict = {"candidates_per_beam": w, "flop_floor_over_beam_1": round(floor_1, 3)}
        for name, times in (("wall", wall), ("cpu", cpu)):
            best = {v: min(t) for v, t in times.items()}
            entry[name] = {
                "best_s": round(best[w], 3),
                "median_s": round(statistics.median(times[w]), 3),
                "over_beam_1": round(best[w] / best[1], 3),
                "over_floor": round(best[w] / best[1] / floor_1, 3),
                "over_beam_256": round(best[w] / best[256], 3),
            }
        entry["flop_floor_over_beam_256"] = round(floor_256, 3)
        entry["select_cpu_ms_per_decode_step"] = round(min(select_ms[w]), 1)
        entry["ranked_per_row_by_decode_step"] = per_row[w]  # row_budget.row_top's width
        out[f"beam_{w}"] = entry
    out["beam_1"] = {"wall_best_s": round(min(wall[1]), 3), "cpu_best_s": round(min(cpu[1]), 3)}
    # the selection alone on random logits, with the row pruning and with each row's top K
    prune_from, alone = row_budget.PRUNE_FROM, {}
    for name, value in (("pruned", prune_from), ("top_k_per_row", 1 << 62)):
        row_budget.PRUNE_FROM = value
        try:
            alone[name] = {
                f"beam_{w}": select_synthetic(1, w, repeats, cfg.vocab_size, 4, (0.0,))[
                    "deterministic"
                ]["select_ms_per_step"]
                for w in WIDE[2:]
            }
        finally:
            row_budget.PRUNE_FROM = prune_from
    out["selection_alone_ms_per_step"] = {"threads": 1, "vocab": cfg.vocab_size, **alone}
    out["target_over_floor"] = 1.1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--wide", type=int, metavar="PROMPT", help="only the anchors' widths")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.wide:
        load = os.getloadavg()
        result = wide(args.wide, args.repeats)
        result["threads"] = torch.get_num_threads()
        result["load_average"] = {"start": load, "end": os.getloadavg()}
        print(json.dumps(result, indent=1))
        return
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
