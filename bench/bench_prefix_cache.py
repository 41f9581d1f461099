"""Prompts sharing a long prefix, with the prefix cache and without it, in one run.

    python bench/bench_prefix_cache.py [--preset cpu|gpu] [--prompts 16] [--prompt-len 2048]
        [--shared-len 1792] [--beam 8] [--new-tokens 3] [--repeats 2]

bench_generate.py's model (preset cpu: the 29M Qwen3 on the CPU; gpu: Qwen3-0.6B's shape in
bf16 on CUDA). The prompts share their first --shared-len tokens and differ after; all are
submitted at once (Engine.generate_many, one batch as a /generate of a list is), to an engine
with the prefix cache, emptied before every run (so each run computes the shared prefix once),
and to one without it; runs alternate, best of --repeats. Prints one JSON object: wall and CPU
seconds of each, their ratio (target: at most 0.3), the prompt tokens each computed, every
request's cached_tokens, and whether both give the same beams.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_generate import PRESETS, build, interleaved  # noqa: E402
from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.engine import Engine  # noqa: E402
from grctl.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from grctl.model import dtypes  # noqa: E402

TARGET = 0.3


def prompts_sharing(num: int, length: int, shared: int, vocab: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(0)
    head = torch.randint(0, vocab, (shared,), generator=gen).tolist()
    tails = torch.randint(0, vocab, (num, length - shared), generator=gen)
    tails[:, 0] = torch.randperm(vocab, generator=gen)[:num]  # each differs right after
    return [tuple(head + t) for t in tails.tolist()]


def measure(
    preset: str = "cpu",
    prompts: int = 16,
    prompt_len: int = 2048,
    shared_len: int = 1792,
    beam: int = 8,
    new_tokens: int = 3,
    repeats: int = 2,
) -> dict:
    """The whole comparison (main's, and bench/gpu_smoke.py's prefix_cache section)."""
    spec = PRESETS[preset]
    shape = spec["shape"]
    _, model = build(shape, dtypes.SERVED_DTYPES[spec["dtype"]], spec["device"])
    texts = prompts_sharing(prompts, prompt_len, shared_len, shape["vocab_size"])
    sp = SamplingParams(max_new_tokens=new_tokens, n=beam)
    reqs = [GenerateRequest(p, sp) for p in texts]
    common = dict(max_running_requests=max(64, prompts), max_context_len=prompt_len + 64)
    cached = Engine(model, EngineConfig(enable_prefill_cache=True, **common))
    plain = Engine(model, EngineConfig(enable_prefill_cache=False, **common))
    for eng in (cached, plain):
        eng.start()

    def with_cache():
        cached.cache.clear()  # each run computes the shared prefix once, as a first would
        return cached.generate_many(reqs)

    times, outs = interleaved({"cached": with_cache, "uncached": lambda: plain.generate_many(reqs)},
                              repeats)  # fmt: skip
    for eng in (cached, plain):
        eng.stop()
    best = {name: min(t["wall"]) for name, t in times.items()}
    cpu = {name: min(t["cpu"]) for name, t in times.items()}
    runs = repeats + 1  # the warm-up runs too
    ratio = best["cached"] / best["uncached"]
    return {
        "preset": preset,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "shared_len": shared_len,
        "beam": beam,
        "new_tokens": new_tokens,
        "cached_s": round(best["cached"], 3),
        "uncached_s": round(best["uncached"], 3),
        "ratio": round(ratio, 3),
        "ratio_cpu_time": round(cpu["cached"] / cpu["uncached"], 3),
        "target": TARGET,
        "met": ratio <= TARGET,
        "prompt_tokens_computed_per_run": {
            "cached": cached.status()["scheduler"]["prefill_tokens"] // runs,
            "uncached": plain.status()["scheduler"]["prefill_tokens"] // runs,
        },
        "cached_tokens": sorted({r.cached_tokens for r in outs["cached"]}),
        "same_beams": [[b.output_ids for b in r.beams] for r in outs["cached"]]
        == [[b.output_ids for b in r.beams] for r in outs["uncached"]],
        "ratios": [
            f"{prompts} prompts sharing {shared_len} of {prompt_len} tokens, cached / uncached: "
            f"{ratio:.3f} (target <= {TARGET}; uncached {best['uncached']:.3f} s)"
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--shared-len", type=int, default=1792)
    ap.add_argument("--beam", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    out = measure(a.preset, a.prompts, a.prompt_len, a.shared_len, a.beam, a.new_tokens, a.repeats)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
