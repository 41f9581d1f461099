"""Mixed decode batches against their requests run alone: one decode step, and whole requests.

    python bench/bench_decode_mix.py [--part step|http|all] [--repeats 3] [--threads N]
        [--mixes mix_1 mix_2]

The 29M Qwen3 of bench_generate.py's cpu preset (hidden 512, 8 layers, 8 heads, 4 KV heads,
head_dim 64, vocab 8192), fp32, random weights. The two target mixes:
- mix_1: 1 request of context 4096 at n=128, plus 31 requests of context 64 at n=1;
- mix_2: 1 request of context 4096, plus 7 of context 256, all n=128.
`step`: one decode step (`runner.decode`, each beam's tail 2 tokens long, random context KV:
attention's cost does not depend on the values) of the whole mix, against each request's step
alone, summed, and against each group of same-shape requests as one batch, summed (the split
the target is stated against). `http`: a real `grctl serve` of the same model (written to a
temporary checkpoint), 4 new tokens; the mix's requests sent at once (one client thread each)
against each request alone one after another, summed, and each group sent at once, summed.
Figures are the best of --repeats (the ways interleaved in each repeat, so load from elsewhere
hits them alike). Prints one JSON object (and each mix's figures to stderr as they come); the
target of every ratio is at most 1.2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_smoke_parts import build  # noqa: E402
from grctl.engine.decode_batch import DecodeItem  # noqa: E402
from grctl.engine.kv_cache import BeamKV, ContextKV  # noqa: E402
from grctl.engine.model_runner import ModelRunner  # noqa: E402

SHAPE = dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_kv_heads=4, head_dim=64,
             intermediate_size=1536, vocab_size=8192, tie_word_embeddings=True,
             max_position_embeddings=8192)  # fmt: skip
# groups of (requests, context tokens, beams)
MIXES = {
    "mix_1": [(1, 4096, 128), (31, 64, 1)],
    "mix_2": [(1, 4096, 128), (7, 256, 128)],
}
NEW_TOKENS = 4
TARGET = 1.2


def best_of(fns: dict, repeats: int, sync=lambda: None) -> dict:
    """{name: fn} -> {name: best seconds}, after one warm-up round, rounds interleaved."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def ratios(best: dict) -> dict:
    together = best["together"]
    return {
        "together_ms": round(together * 1e3, 1),
        "alone_summed_ms": round(best["alone"] * 1e3, 1),
        "groups_summed_ms": round(best["groups"] * 1e3, 1),
        "over_alone": round(together / best["alone"], 3),
        "over_groups": round(together / best["groups"], 3),
        "target": TARGET,
    }


# ---- one decode step ------------------------------------------------------------------------


def step_items(runner: ModelRunner, mix: list, step: int = 1) -> list[list[DecodeItem]]:
    """Per group, its requests' DecodeItems: random context KV, each beam fed at `step`."""
    cfg, dev, dtype = runner.config, runner.device, runner.dtype
    groups = []
    for num, context, beams in mix:
        items = []
        for _ in range(num):
            shape = (cfg.num_kv_heads, context, cfg.head_dim)
            ks = tuple(torch.randn(shape, device=dev, dtype=dtype) for _ in range(cfg.num_layers))
            vs = tuple(torch.randn(shape, device=dev, dtype=dtype) for _ in range(cfg.num_layers))
            kv = BeamKV(cfg.num_layers, beams, cfg.num_kv_heads, step + 2, cfg.head_dim, dtype, dev)
            kv.data.normal_()
            ids = torch.randint(0, cfg.vocab_size, (beams,), device=dev)
            items.append(DecodeItem(ContextKV(ks, vs), kv, ids, step))
        groups.append(items)
    return groups


def step_part(runner: ModelRunner, repeats: int, mixes: tuple[str, ...] = tuple(MIXES)) -> dict:
    """Each mix as one step, alone and by groups; and the largest difference of the mix's logits
    from each request's own step (fp32: rounding only)."""
    dev = runner.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    for name in mixes:
        groups = step_items(runner, MIXES[name])
        every = [it for g in groups for it in g]

        def alone(every=every):
            return [runner.decode([it]) for it in every]

        def by_group(groups=groups):
            for g in groups:
                runner.decode(g)

        diff = (runner.decode(every) - torch.cat(alone())).abs().max().item()
        fns = {"together": lambda e=every: runner.decode(e), "alone": alone, "groups": by_group}
        out[name] = {"rows": sum(it.beam_kv.num_beams for it in every)}
        out[name].update(ratios(best_of(fns, repeats, sync)), max_abs_diff_vs_alone=diff)
        print(json.dumps({name: out[name]}), file=sys.stderr)
        del groups, every
    return out


def gpu_part(device: torch.device, dry_run: bool) -> dict:
    """bench/gpu_smoke.py's decode_mix section: the step part on the Qwen3-0.6B shape in bf16,
    decoding through CUDA graphs (the tiny shape on the CPU for --dry-run)."""
    from bench.gpu_smoke_parts import SHAPES

    dtype = torch.float32 if dry_run else torch.bfloat16
    model = build(SHAPES["tiny" if dry_run else "0.6b"], device, dtype)
    runner = ModelRunner(model, device)
    if device.type == "cuda":
        runner.capture_graphs()
    with torch.inference_mode():
        out = step_part(runner, repeats=1 if dry_run else 3)
    out["cuda_graphs"] = runner.graphs.stats() if runner.graphs is not None else None
    out["ratios"] = [
        f"{name} one step / alone summed: {r['over_alone']:.3f}, / groups summed: "
        f"{r['over_groups']:.3f} (target <= {TARGET}; together {r['together_ms']:.1f} ms)"
        for name, r in out.items()
        if name in MIXES
    ]
    return out


# ---- whole requests over HTTP ---------------------------------------------------------------


def http_part(
    model, repeats: int, threads: int | None, mixes: tuple[str, ...] = tuple(MIXES)
) -> dict:
    from grctl.weights.loader import export_hf
    from tests.support.serverproc import running_server

    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="grctl-bench-mix-") as tmp:
        ckpt = export_hf(model, Path(tmp) / "ckpt")
        args = ["--model-path", str(ckpt), "--device", "cpu", "--max-running-requests", "64",
                "--max-context-len", "4200", "--max-new-tokens", str(NEW_TOKENS)]  # fmt: skip
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        with running_server(*args, env=env) as srv, srv.client(timeout=600) as http:
            pool = ThreadPoolExecutor(64)

            def one(body: dict) -> None:
                reply = http.post("/generate", json=body)
                assert reply.status_code == 200, reply.text[:300]

            def at_once(bodies: list[dict]) -> None:
                list(pool.map(one, bodies))

            out = {}
            for name in mixes:
                groups = []
                for num, context, beams in MIXES[name]:
                    sp = {"max_new_tokens": NEW_TOKENS, "n": beams}
                    groups.append([
                        {"input_ids": torch.randint(0, SHAPE["vocab_size"], (context,),
                                                    generator=gen).tolist(), "sampling_params": sp}
                        for _ in range(num)
                    ])  # fmt: skip
                every = [b for g in groups for b in g]
                fns = {
                    "together": lambda e=every: at_once(e),
                    "alone": lambda e=every: [one(b) for b in e],
                    "groups": lambda g=groups: [at_once(x) for x in g],
                }
                out[name] = ratios(best_of(fns, repeats))
                print(json.dumps({name: out[name]}), file=sys.stderr)
            pool.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["step", "http", "all"], default="all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch threads here and in the server")
    ap.add_argument("--mixes", nargs="+", choices=sorted(MIXES), default=list(MIXES))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(SHAPE, torch.device("cpu"), torch.float32)
    report: dict = {
        "model": "29M Qwen3 (hidden 512, 8 layers), fp32, cpu",
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
    }
    if args.part in ("step", "all"):
        with torch.inference_mode():
            runner = ModelRunner(model, torch.device("cpu"))
            report["step"] = step_part(runner, args.repeats, args.mixes)
    if args.part in ("http", "all"):
        report["http"] = http_part(model, args.repeats, args.threads, args.mixes)
        report["http"]["new_tokens"] = NEW_TOKENS
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
