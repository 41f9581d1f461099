"""release/resume_memory_occupation: how long each takes, how much device memory it frees, and
that generation after resume equals generation before (verl's colocate cycle, on the engine).

A random ~1 GiB bf16 model (bench/common.py ONE_GIB_CONFIG) on the chosen device: a 512-token
(CPU: 128) beam-8 request, then release all tags, resume weights, resume the rest, the same request
again. On CUDA the figures include torch.cuda.memory_allocated / memory_reserved before, after the
release and after the resume (the release's empty_cache returns reserved memory to the driver).
Prints one JSON object.

    python bench/bench_memory.py [--device cpu|cuda] [--repeats 3]
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

from bench.common import ONE_GIB_CONFIG  # noqa: E402
from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.engine import Engine  # noqa: E402
from grctl.engine.qwen3 import Qwen3ForCausalLM  # noqa: E402
from grctl.engine.request import GenerateRequest, SamplingParams  # noqa: E402


def device_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    return {
        "allocated_mib": round(torch.cuda.memory_allocated(device) / 2**20, 1),
        "reserved_mib": round(torch.cuda.memory_reserved(device) / 2**20, 1),
    }


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(ONE_GIB_CONFIG).to(torch.bfloat16)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    eng = Engine(model, EngineConfig(device=str(device), enable_prefill_cache=True))
    eng.start()
    prompt_len = 512 if device.type == "cuda" else 128  # a CPU run stays under a minute
    prompt = tuple(torch.randint(0, ONE_GIB_CONFIG.vocab_size, (prompt_len,)).tolist())
    req = GenerateRequest(prompt, SamplingParams(max_new_tokens=3, n=8))
    try:
        before = eng.generate(req, timeout=600)
        out: dict = {
            "device": str(device),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "memory_before": device_memory(device),
        }
        release_s, resume_w_s, resume_rest_s, same = [], [], [], True
        for _ in range(args.repeats):
            release_s.append(timed(lambda: eng.release_memory(None)))
            out["memory_released"] = device_memory(device)
            resume_w_s.append(timed(lambda: eng.resume_memory(["weights"])))
            resume_rest_s.append(timed(lambda: eng.resume_memory(None)))
            out["memory_resumed"] = device_memory(device)
            after = eng.generate(req, timeout=600)
            same &= [b.output_ids for b in after.beams] == [b.output_ids for b in before.beams]
        for name, xs in (
            ("release_all_s", release_s),
            ("resume_weights_s", resume_w_s),
            ("resume_rest_s", resume_rest_s),
        ):
            out[name] = {"best": round(min(xs), 4), "median": round(statistics.median(xs), 4)}
        out["outputs_equal_after_resume"] = same
    finally:
        eng.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
