"""Generation latency and throughput: our engine against transformers' generate().

Preset `cpu` (the default): a 29M-parameter Qwen3 (hidden 512, 8 layers, 8 heads, 4 KV heads,
head_dim 64, intermediate 1536, vocab 8192, tied) with random weights, loaded into both through
our weight sink; a 512-token prompt, 3 new tokens, beam widths 1, 8 and 32, same precision, same
run. Preset `gpu`: Qwen3-0.6B-shaped random bf16 weights on CUDA, prompt 1024, beam 128.
Runs alternate between the two (the machine may be shared) and each figure is the best of N
runs, with the median beside it. Prints one JSON object: per width the latencies, their ratio and
whether the top sequences agree; then the throughput of concurrent requests of the widest beam.

    python bench/bench_generate.py [--preset cpu|gpu] [--repeats 5] [--dtype float32]
    python bench/bench_generate.py --decode-cost 2048 [--repeats 3]   # beside the FLOP floor
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.flops import prefill_flops, request_flops  # noqa: E402
from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.engine import Engine  # noqa: E402
from grctl.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from grctl.model import dtypes  # noqa: E402
from grctl.model.config import ModelConfig  # noqa: E402
from grctl.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from grctl.weights import apply  # noqa: E402

PRESETS = {
    "cpu": dict(
        shape=dict(
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=1536,
            vocab_size=8192,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        ),
        device="cpu",
        dtype="float32",
        prompt_len=512,
        widths=(1, 8, 32),
        concurrent=8,
    ),
    "gpu": dict(
        shape=dict(
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
        device="cuda",
        dtype="bfloat16",
        prompt_len=1024,
        widths=(128,),
        concurrent=4,
    ),
}
NEW_TOKENS = 3


def build(shape: dict, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).eval()
    ours = Qwen3ForCausalLM(ModelConfig.from_hf(hf.config.to_dict())).eval()
    apply.load_tensors(ours, list(hf.state_dict().items()), require_full=True)
    return hf.to(device, dtype), ours.to(device, dtype)


def timed(fn) -> tuple[float, float, object]:
    """-> (wall seconds, this process's CPU seconds over all its threads, fn's output)."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w0, time.process_time() - c0, out


def interleaved(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Run each fn once to warm up, then `repeats` rounds alternating between them, so load
    from elsewhere on the machine hits both alike.
    -> ({name: {"wall": [s], "cpu": [s]}}, {name: last output})"""
    outs = {name: fn() for name, fn in fns.items()}
    times: dict = {name: {"wall": [], "cpu": []} for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu, outs[name] = timed(fn)
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
    return times, outs


def summary(hf: dict, ours: dict) -> dict:
    """Wall time best-of-N (the least disturbed run) and median, and CPU time best-of-N (less
    sensitive to other load on a shared machine); each with transformers / grctl."""
    out = {}
    for key, pick in (("", min), ("median_", statistics.median)):
        a, b = pick(hf["wall"]), pick(ours["wall"])
        out[f"transformers_{key}ms"] = round(a * 1e3, 1)
        out[f"grctl_{key}ms"] = round(b * 1e3, 1)
        out[f"speedup{'_' + key[:-1] if key else ''}"] = round(a / b, 2)
    a, b = min(hf["cpu"]), min(ours["cpu"])
    out.update(transformers_cpu_ms=round(a * 1e3, 1), grctl_cpu_ms=round(b * 1e3, 1))
    out["speedup_cpu"] = round(a / b, 2)
    return out


def hf_generate(hf, ids: list[int], width: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids], device=hf.device),
            max_new_tokens=NEW_TOKENS,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            length_penalty=0.0,
        )
    return out[0, len(ids) :].tolist()


def request(ids: list[int], width: int) -> GenerateRequest:
    return GenerateRequest(tuple(ids), SamplingParams(max_new_tokens=NEW_TOKENS, n=width))


def decode_cost(engine: Engine, prompt_len: int, repeats: int) -> dict:
    """What decoding adds to prefill (grctl alone): one beam-256 request against the same prompt
    at beam 1, and 8 concurrent beam-64 requests against their 8 prefills alone (1 new token,
    which comes from the prefill); each ratio beside its FLOP floor (bench/flops.py), the ratio
    of the two sides' FLOPs. Target: beam 256 within 1.1x of its floor."""
    cfg = engine.runner.config
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(8)
    ]

    def burst(width: int, new_tokens: int) -> None:
        sp = SamplingParams(max_new_tokens=new_tokens, n=width)
        for rid in [engine.submit(GenerateRequest(tuple(p), sp)) for p in prompts]:
            engine.result(rid)

    times, _ = interleaved(
        {
            "beam_1": lambda: engine.generate(request(prompts[0], 1)),
            "beam_256": lambda: engine.generate(request(prompts[0], 256)),
            "prefill_x8": lambda: burst(64, 1),
            "beam_64_x8": lambda: burst(64, NEW_TOKENS),
        },
        repeats,
    )
    best = {name: min(t["wall"]) for name, t in times.items()}
    cpu = {name: min(t["cpu"]) for name, t in times.items()}
    wide = best["beam_256"] / best["beam_1"]
    floor = request_flops(cfg, prompt_len, 256, NEW_TOKENS) / request_flops(
        cfg, prompt_len, 1, NEW_TOKENS
    )
    floor_x8 = request_flops(cfg, prompt_len, 64, NEW_TOKENS) / prefill_flops(cfg, prompt_len)
    return {
        "prompt_tokens": prompt_len,
        "ms": {name: round(s * 1e3, 1) for name, s in best.items()},
        "cpu_ms": {name: round(s * 1e3, 1) for name, s in cpu.items()},
        "beam_256_over_beam_1": round(wide, 3),
        "beam_256_flop_floor": round(floor, 3),
        "beam_256_over_floor": round(wide / floor, 3),
        "beam_256_over_floor_target": 1.1,
        "beam_64_x8_over_prefill_x8": round(best["beam_64_x8"] / best["prefill_x8"], 3),
        "beam_64_x8_flop_floor": round(floor_x8, 3),
        "cpu_time_ratios": [
            round(cpu["beam_256"] / cpu["beam_1"], 3),
            round(cpu["beam_64_x8"] / cpu["prefill_x8"], 3),
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the preset's")
    parser.add_argument(
        "--decode-cost",
        type=int,
        metavar="PROMPT",
        help="only measure what decoding adds to prefill at this prompt length (grctl alone)",
    )
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    shape, device, width_max = preset["shape"], preset["device"], max(preset["widths"])
    dtype = args.dtype or preset["dtype"]
    transformers.logging.set_verbosity_error()
    hf, ours = build(shape, dtypes.SERVED_DTYPES[dtype], device)
    engine = Engine(ours, EngineConfig(device=device, max_new_tokens=NEW_TOKENS))
    engine.start()
    if args.decode_cost:
        result = decode_cost(engine, args.decode_cost, args.repeats)
        engine.stop()
        print(json.dumps({"preset": args.preset, "dtype": dtype, **result}, indent=2))
        return
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (preset["prompt_len"],), generator=gen).tolist()
    report: dict = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "params_m": round(sum(p.numel() for p in ours.parameters()) / 1e6, 1),
        "prompt_tokens": preset["prompt_len"],
        "new_tokens": NEW_TOKENS,
        "repeats": args.repeats,
        "latency": {},
    }
    for width in preset["widths"]:
        times, outs = interleaved(
            {
                "hf": lambda w=width: hf_generate(hf, ids, w),  # returns after a sync
                "ours": lambda w=width: engine.generate(request(ids, w)),
            },
            args.repeats,
        )
        report["latency"][f"beam_{width}"] = {
            **summary(times["hf"], times["ours"]),
            "same_top_sequence": outs["ours"].output_ids == outs["hf"],
        }
    prompts = [
        torch.randint(0, shape["vocab_size"], (preset["prompt_len"],), generator=gen).tolist()
        for _ in range(preset["concurrent"])
    ]

    def burst() -> None:
        rids = [engine.submit(request(p, width_max)) for p in prompts]
        for rid in rids:
            engine.result(rid)

    burst_times, _ = interleaved({"burst": burst}, args.repeats)
    burst_s = min(burst_times["burst"]["wall"])
    hf_rps = 1e3 / report["latency"][f"beam_{width_max}"]["transformers_ms"]
    concurrent = preset["concurrent"]
    report[f"throughput_beam_{width_max}"] = {
        "concurrent_requests": concurrent,
        "grctl_wall_ms": round(burst_s * 1e3, 1),
        "grctl_requests_per_s": round(concurrent / burst_s, 2),
        "transformers_requests_per_s": round(hf_rps, 3),  # one request at a time, best-of
        "speedup": round(concurrent / burst_s / hf_rps, 2),
    }
    engine.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
