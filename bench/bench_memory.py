"""release/resume_memory_occupation: how long each takes, how much device memory it frees, and
that generation after resume equals generation before (verl's colocate cycle, on the engine).

A model with random bf16 weights (Qwen3-0.6B's shape on CUDA, `--shape`), prefill cache on, CUDA
decode graphs captured for one 16-row bucket: one beam-16 request (prompt 1024, or 128 on the
CPU), then release of every tag, resume of the weights, resume of the rest (graphs captured
again), the same request.
On CUDA: torch.cuda.memory_allocated / memory_reserved before, released and resumed, and, as the
same-run reference for the release and resume times, a plain device-to-pinned-host copy of the
same bytes and back. bench/gpu_smoke.py runs `memory_part` as its "memory" section.

    python bench/bench_memory.py [--device cpu|cuda] [--shape 0.6b|tiny] [--repeats 2]
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

from bench.gpu_smoke_parts import SHAPES, build  # noqa: E402
from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.engine import Engine  # noqa: E402
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


def copy_reference_s(model: torch.nn.Module, device: torch.device) -> dict:
    """A plain copy of every parameter to pinned host memory and back: what a release and a
    resume of the weights cannot beat."""
    if device.type != "cuda":
        return {}
    params = list(model.parameters())
    hosts = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for h, p in zip(hosts, params, strict=True):
        h.copy_(p)
    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    back = [h.to(device) for h in hosts]
    torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    del back
    return {"to_host_s": round(t1 - t0, 4), "to_device_s": round(t2 - t1, 4)}


def memory_part(device: torch.device, shape: str = "0.6b", repeats: int = 2) -> dict:
    model = build(SHAPES[shape], device)
    eng = Engine(model, EngineConfig(device=str(device), enable_prefill_cache=True))
    if device.type == "cuda":  # one bucket for the 16 beams: a short capture, recaptured twice
        from grctl.engine.cuda_graphs import DecodeGraphs

        eng.runner.graphs = DecodeGraphs(model, device, (16,))
    eng.start()
    vocab = SHAPES[shape]["vocab_size"]
    prompt_len = 1024 if device.type == "cuda" else 128
    gen = torch.Generator().manual_seed(0)
    prompt = tuple(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist())
    req = GenerateRequest(prompt, SamplingParams(max_new_tokens=3, n=16))
    out: dict = {"device": str(device), "shape": shape}
    try:
        before = [b.output_ids for b in eng.generate(req, timeout=600).beams]
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        out["graphs_captured"] = eng.runner.graphs is not None
        out["memory_before"] = device_memory(device)
        release, resume_w, resume_rest, same = [], [], [], True
        for _ in range(repeats):
            release.append(timed(lambda: eng.release_memory(None)))
            out["memory_released"] = device_memory(device)
            resume_w.append(timed(lambda: eng.resume_memory(["weights"])))
            resume_rest.append(timed(lambda: eng.resume_memory(None)))
            out["memory_resumed"] = device_memory(device)
            out["graphs_recaptured"] = eng.runner.graphs is not None
            again = [b.output_ids for b in eng.generate(req, timeout=600).beams]
            same &= again == before
        for name, xs in (
            ("release_all_s", release),
            ("resume_weights_s", resume_w),
            ("resume_rest_s", resume_rest),
        ):
            out[name] = {"best": round(min(xs), 4), "median": round(statistics.median(xs), 4)}
        out["outputs_equal_after_resume"] = same
        out["copy_reference"] = copy_reference_s(model, device)
    finally:
        eng.stop()
    freed = out["memory_before"].get("allocated_mib", 0) - out.get("memory_released", {}).get(
        "allocated_mib", 0
    )
    out["ratios"] = [
        f"release frees {freed:.0f} MiB allocated (weights {out['weight_bytes'] / 2**20:.0f} MiB),"
        f" release {out['release_all_s']['best']} s vs copy to host"
        f" {out['copy_reference'].get('to_host_s')} s, resume weights"
        f" {out['resume_weights_s']['best']} s vs copy back"
        f" {out['copy_reference'].get('to_device_s')} s, outputs equal after resume: {same}"
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, help="0.6b (CUDA default) or tiny (CPU default)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = args.shape or ("0.6b" if device.type == "cuda" else "tiny")
    print(json.dumps(memory_part(device, shape, args.repeats), indent=1))


if __name__ == "__main__":
    main()
