"""The sections of bench/gpu_smoke.py: graphs, generation, CUDA IPC push, disk load."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.flops import prefill_flops, request_flops
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.model.config import ModelConfig
from grctl.model.dtypes import name_of
from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.weights.loader import empty_model, export_hf

H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (NVIDIA's H200 SXM figure)
HF_SHAPE = dict(rms_norm_eps=1e-6, max_position_embeddings=40960)
SHAPES = {
    "0.6b": dict(num_layers=28, hidden_size=1024, num_attention_heads=16, num_kv_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936,
                 tie_word_embeddings=True),
    "1.7b": dict(num_layers=28, hidden_size=2048, num_attention_heads=16, num_kv_heads=8,
                 head_dim=128, intermediate_size=6144, vocab_size=151936,
                 tie_word_embeddings=True),
    "8b": dict(num_layers=36, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
               head_dim=128, intermediate_size=12288, vocab_size=151936,
               tie_word_embeddings=False),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=96, vocab_size=512, tie_word_embeddings=False),
}  # fmt: skip


def build(shape: dict, device: torch.device, dtype=torch.bfloat16, seed: int = 0):
    """Random weights written in place on the device (no host copy of the model)."""
    cfg = ModelConfig(**shape, torch_dtype=name_of(dtype))
    model = empty_model(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


class Timer:
    """CUDA events on the GPU (device time), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return round(start.elapsed_time(end), 3)
        return round((end - start) * 1e3, 3)


def timed_calls(runner, timer: Timer, log: list) -> None:
    """Wrap the runner's passes: each call's device time lands in `log` as (name, ms)."""
    for name in ("prefill", "decode"):
        fn = getattr(runner, name)

        def wrapper(*a, _fn=fn, _name=name, **k):
            start = timer.mark()
            out = _fn(*a, **k)
            log.append((_name, start, timer.mark()))
            return out

        setattr(runner, name, wrapper)


def run_all(eng: Engine, reqs: list[GenerateRequest]) -> list:
    ids = [eng.submit(r) for r in reqs]
    while eng.run_step():
        pass
    return [eng.result(i) for i in ids]


# ---- graphs ---------------------------------------------------------------------------------


def graphs_part(device: torch.device) -> dict:
    from grctl.engine.cuda_graphs import DecodeGraphs, EagerPiece

    model = build(SHAPES["tiny"], device, torch.float32, seed=3)
    graphed = Engine(model, EngineConfig(device=str(device)))
    # steps run by hand in this thread (no worker): capture here, on the model's device
    capture = {"capture": EagerPiece} if device.type == "cpu" else {}
    graphed.runner.graphs = DecodeGraphs(model, device, (4, 16), **capture)
    eager = Engine(model, EngineConfig(device=str(device), cuda_graph=False))
    gen = torch.Generator().manual_seed(0)
    reqs = [
        GenerateRequest(
            tuple(torch.randint(0, 512, (5 + 9 * i,), generator=gen).tolist()),
            SamplingParams(max_new_tokens=4, n=n),
        )
        for i, n in enumerate((4, 3, 20, 1))
    ]

    def outputs(eng):
        return [
            [(b.output_ids, round(b.sequence_score, 3)) for b in r.beams]
            for r in run_all(eng, reqs)
        ]

    graphs = graphed.runner.graphs
    assert graphs is not None, "no CUDA graphs were captured"
    before, replays0 = outputs(graphed), graphs.num_replays
    same_before = before == outputs(eager)
    seconds = {}
    for name, eng in (("graphs", graphed), ("eager", eager)):  # warm now: best of 3
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            outputs(eng)
            if device.type == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        seconds[name] = min(runs)
    with graphed.exclusive():  # an in-place weight update: same storage, new values
        model.norm.weight.mul_(-1.0)
        model.layers[0].mlp.down_proj.weight.mul_(3.0)
    after = outputs(graphed)
    return {
        "graph_equals_eager": same_before,
        "graph_equals_eager_after_update": after == outputs(eager),
        "outputs_moved_with_the_weights": after != before,
        "replays": graphs.num_replays - replays0,
        "buckets": graphs.stats()["buckets"],
        "graphs_ms": round(seconds["graphs"] * 1e3, 2),
        "eager_ms": round(seconds["eager"] * 1e3, 2),
        "ratios": [
            f"graphs == eager: {same_before}, after an in-place update: {after != before}",
            f"decode of the 4 requests through graphs / eager: "
            f"{seconds['graphs'] / seconds['eager']:.3f} ({seconds['graphs'] * 1e3:.1f} ms vs "
            f"{seconds['eager'] * 1e3:.1f} ms, best of 3; the tiny shape: launch-bound)",
        ],
    }


# ---- the device's outputs against the CPU path ----------------------------------------------


def parity_part(device: torch.device) -> dict:
    """Greedy and beam outputs of one model on `device` against the same weights on the CPU
    (float32 both, the head scaled so that the random logits are far apart: a near-tie may
    flip between two devices' summation orders, a real bug flips many)."""
    cpu = torch.device("cpu")
    ref = build(SHAPES["tiny"], cpu, torch.float32, seed=5)
    with torch.no_grad():
        ref.lm_head.weight.mul_(40.0)
    dev = empty_model(ref.config, device, torch.float32)
    dev.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(2)
    prompts = [tuple(torch.randint(0, 512, (9 + 7 * i,), generator=gen).tolist()) for i in range(4)]
    cases = {
        "greedy": SamplingParams(max_new_tokens=8),
        "beam_8": SamplingParams(max_new_tokens=3, n=8),
    }

    def outputs(model, where) -> dict:
        eng = Engine(model, EngineConfig(device=str(where)))
        return {
            case: [
                [b.output_ids for b in r.beams]
                for r in run_all(eng, [GenerateRequest(p, sp) for p in prompts])
            ]
            for case, sp in cases.items()
        }

    want, got = outputs(ref, cpu), outputs(dev, device)
    equal = {case: want[case] == got[case] for case in cases}
    return {
        **{f"{case}_equal_to_cpu": ok for case, ok in equal.items()},
        "mismatches": {c: [got[c], want[c]] for c, ok in equal.items() if not ok},
        "ratios": [
            f"{device.type} outputs == CPU path: "
            + ", ".join(f"{c} {ok}" for c, ok in equal.items())
        ],
    }


# ---- generation -----------------------------------------------------------------------------


def generate_part(device: torch.device, shape: dict, dry_run: bool) -> dict:
    prompt_len, width = (64, 8) if dry_run else (5000, 256)
    model = build(shape, device)
    cfg = model.config
    eng = Engine(
        model,
        EngineConfig(
            device=str(device),
            max_context_len=prompt_len + 8,
            max_beam_width=width,
            max_new_tokens=3,
            prefill_token_budget=prompt_len,
            enable_prefill_cache=False,  # the measured run repeats the warm-up's prompts
        ),
    )
    if device.type == "cuda":  # one bucket: a beam-256 request decodes through graphs
        from grctl.engine.cuda_graphs import DecodeGraphs

        eng.runner.graphs = DecodeGraphs(model, device, (width,))
    timer, log = Timer(device), []
    timed_calls(eng.runner, timer, log)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(8)
    ]

    def case(num: int, new_tokens: int) -> dict:
        sp = SamplingParams(max_new_tokens=new_tokens, n=width)
        reqs = [GenerateRequest(tuple(p), sp) for p in prompts[:num]]
        run_all(eng, reqs)  # warm-up (kernel choice, allocator)
        log.clear()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = timer.mark()
        run_all(eng, reqs)
        total = timer.ms(start, timer.mark())
        calls = [(n, timer.ms(s, e)) for n, s, e in log]
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        return {"total_ms": total, "calls_ms": calls, "peak_bytes": peak}

    out = {"params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3)}
    for num in (1, 8):
        out[f"prefill_only_x{num}"] = case(num, 1)
        out[f"beam_{width}_x{num}"] = case(num, 3)
    pre1 = out["prefill_only_x1"]["calls_ms"][0][1]
    tflops = prefill_flops(cfg, prompt_len) / (pre1 / 1e3) / 1e12
    r1 = out[f"beam_{width}_x1"]["total_ms"] / out["prefill_only_x1"]["total_ms"]
    r8 = out["prefill_only_x8"]["total_ms"] / out[f"beam_{width}_x8"]["total_ms"]
    out["prefill_tflops"] = round(tflops, 1)
    out["prefill_share_of_bf16_peak"] = round(tflops * 1e12 / H200_BF16_PEAK, 3)
    out["beam_over_prefill_x1"] = round(r1, 3)
    floor = request_flops(cfg, prompt_len, width, 3) / prefill_flops(cfg, prompt_len)
    out["beam_over_prefill_flop_floor"] = round(floor, 3)
    out["throughput_vs_prefill_only_x8"] = round(r8, 3)
    out[f"beam_{width}_x8_req_per_s"] = round(8e3 / out[f"beam_{width}_x8"]["total_ms"], 2)
    out["ratios"] = [
        f"beam-{width} request / its prefill alone: {r1:.3f} (target <= 1.3; FLOP floor "
        f"{floor:.3f}; prefill {out['prefill_only_x1']['total_ms']:.1f} ms)",
        f"8 requests: throughput / prefill-only throughput: {r8:.3f} (target >= 0.8; prefill-only "
        f"{out['prefill_only_x8']['total_ms']:.1f} ms)",
        f"8 beam-{width} requests at context {prompt_len}: "
        f"{out[f'beam_{width}_x8_req_per_s']} req/s (target >= 35 for 1.7B on one H200)",
        f"prefill {prompt_len} tokens: {tflops:.1f} TFLOP/s = "
        f"{out['prefill_share_of_bf16_peak']:.3f} of bf16 peak (target >= 0.6 for 8B)",
    ]
    out["profile_top10"] = profile(eng, prompts[0], width, device)
    from grctl.model import attention

    # False: the fused CUDA kernel refused a shape and decode fell back to the fp32 math path
    out["decode_attention_fused"] = device.type != "cuda" or attention._cuda_fused[0]
    out["transformers_prefill_ms"] = hf_prefill_ms(model, prompts[0], device, timer)
    out["ratios"].append(
        f"transformers prefill of the same prompt: {out['transformers_prefill_ms']} ms vs "
        f"grctl {pre1} ms"
    )
    return out


def profile(eng: Engine, prompt: list[int], width: int, device: torch.device) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with prof(activities=acts) as p:
        run_all(eng, [GenerateRequest(tuple(prompt), SamplingParams(max_new_tokens=3, n=width))])
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return p.key_averages().table(sort_by=key, row_limit=10)


def hf_prefill_ms(model: Qwen3ForCausalLM, prompt: list[int], device, timer: Timer) -> float:
    """transformers' Qwen3 on the same weights (bf16, its default attention), one forward."""
    import transformers

    from grctl.weights.views import hf_state_dict

    cfg = model.config
    hf_cfg = transformers.Qwen3Config(**{**cfg.to_hf(), **HF_SHAPE})
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(hf_cfg).to(next(model.parameters()).dtype)
    hf = hf.to_empty(device=device).eval()
    hf.load_state_dict(hf_state_dict(model), strict=False, assign=False)
    rotary = type(hf.model.rotary_emb)  # its inv_freq buffer is not in the state dict
    hf.model.rotary_emb = rotary(hf_cfg).to(device)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        hf(ids, logits_to_keep=1)  # warm-up
        start = timer.mark()
        hf(ids, logits_to_keep=1)
        ms = timer.ms(start, timer.mark())
    del hf
    return ms


# ---- CUDA IPC push --------------------------------------------------------------------------


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy()).hexdigest()


def ipc_child(dry_run: bool, shape: str) -> int:
    """The trainer side: the model's weights staged in 512 MiB buckets on its GPU; each payload
    goes out as one JSON line, and the next waits for the parent's 'ok' (the reply)."""
    from grctl.client.sources import NamedTensors
    from grctl.client.staging import plan_buckets, stage
    from grctl.weights.views import hf_state_dict

    device = torch.device("cpu" if dry_run else "cuda")
    model = build(SHAPES["tiny" if dry_run else shape], device, seed=7)
    state = {k: v.detach() for k, v in hf_state_dict(model).items()}
    source = NamedTensors(state)  # what a trainer pushes: its own tensors, by reference
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    plans = plan_buckets(source.specs(), None, 512 << 20)
    print(json.dumps({"ready": True, "buckets": len(plans)}), flush=True)
    assert sys.stdin.readline().strip() == "go"  # the parent has paused its engine
    for plan in plans:
        bucket = stage(source, plan, device)
        print(json.dumps({"payload": bucket.payload(), "nbytes": plan.nbytes}), flush=True)
        assert sys.stdin.readline().strip() == "ok"
        bucket.free()
        del bucket
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
    left = (torch.cuda.memory_allocated() - base) if device.type == "cuda" else 0
    sums = {n: sha(t) for n, t in state.items()}
    print(json.dumps({"done": True, "checksums": sums, "child_bytes_left": left}), flush=True)
    return 0


def ipc_part(device: torch.device, shape: str, dry_run: bool, deadline: float) -> dict:
    """A colocated CUDA IPC sync of `shape`, as a trainer runs it: pause the engine, apply
    every bucket the child stages, continue; timed from the pause to the continue."""
    from grctl.weights.checker import checksums
    from grctl.weights.tensor import update_from_tensor
    from grctl.weights.updater import WeightUpdater

    model = build(SHAPES["tiny" if dry_run else shape], device, seed=1)
    eng = Engine(model, EngineConfig(device=str(device), cuda_graph=False))
    updater = WeightUpdater(eng)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_smoke.py")), "--ipc-child",
           "--ipc-shape", shape]  # fmt: skip
    child = subprocess.Popen(cmd + (["--dry-run"] if dry_run else []), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    server_ms, nbytes = [], 0
    try:
        ready = json.loads(child.stdout.readline())
        assert ready.get("ready"), ready
        t0 = time.perf_counter()
        eng.pause("in_place")
        print("go", file=child.stdin, flush=True)
        while True:
            msg = json.loads(child.stdout.readline())
            if msg.get("done"):
                break
            out = update_from_tensor(updater, [msg["payload"]], "flattened_bucket",
                                     weight_version="ipc", flush_cache=False)  # fmt: skip
            server_ms.append(out.elapsed_ms)
            nbytes += msg["nbytes"]
            print("ok", file=child.stdin, flush=True)
            assert time.monotonic() < deadline, "out of time"
        eng.resume()
        wall = time.perf_counter() - t0
    finally:
        child.stdin.close()
        child.wait(60)
    mine = {n: c["sha256"] for n, c in checksums(model).items()}
    left = (torch.cuda.memory_allocated() - base) if device.type == "cuda" else 0
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst, timer = torch.empty_like(src), Timer(device)
    dst.copy_(src)
    start = timer.mark()
    dst.copy_(src)
    d2d_ms = timer.ms(start, timer.mark())
    del src, dst
    server = sum(server_ms)
    target = 1.0 if shape == "8b" else None
    return {
        "shape": shape,
        "bytes": nbytes,
        "buckets": len(server_ms),
        "checksums_match": mine == msg["checksums"],
        "server_ms": round(server, 1),
        "pause_to_continue_s": round(wall, 3),
        "gb_per_s": round(nbytes / 1e9 / wall, 2),
        "d2d_copy_ms": d2d_ms,
        "server_bytes_left": left,
        "child_bytes_left": msg["child_bytes_left"],
        "ratios": [
            f"IPC update (server) / device copy of the same bytes: {server / d2d_ms:.2f} "
            f"(target <= 1.5; copy {d2d_ms:.1f} ms of {nbytes / 1e9:.2f} GB)",
            f"pause to continue, staging included: {wall:.3f} s = {wall * 1e3 / d2d_ms:.2f}x "
            f"the device copy" + (f" (target < {target} s)" if target else ""),
        ],
    }


# ---- disk -----------------------------------------------------------------------------------


def disk_part(device: torch.device, dry_run: bool) -> dict:
    from grctl.weights.disk import update_from_disk
    from grctl.weights.updater import WeightUpdater

    shape = SHAPES["tiny" if dry_run else "0.6b"]
    with tempfile.TemporaryDirectory(prefix="grctl-smoke-") as tmp:
        path = export_hf(build(shape, device, seed=5), Path(tmp) / "ckpt")
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        model = build(shape, device, seed=6)
        updater = WeightUpdater(Engine(model, EngineConfig(device=str(device), cuda_graph=False)))
        times = []
        for i in range(3):  # the first reads the file into the page cache
            out = update_from_disk(updater, str(path), weight_version=f"disk-{i}")
            times.append(out.elapsed_ms)
    best = min(times[1:])
    gbps = nbytes / (best / 1e3) / 1e9
    return {
        "bytes": nbytes,
        "elapsed_ms": times,
        "gb_per_s_page_cache": round(gbps, 2),
        "ratios": [f"disk update from the page cache: {gbps:.2f} GB/s (target >= 10)"],
    }
