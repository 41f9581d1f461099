"""Rollout throughput as an RL trainer drives it: a flood of prompts of mixed lengths, beam
search under an item catalog, over HTTP, beside its references measured in the same run.

    python bench/bench_rollout.py                  # reduced sizes, a few minutes on 2 CPU cores
    python bench/bench_rollout.py --full           # the target's: 256 prompts of 256-2,048
                                                   # tokens, beam 16, a 1M-item catalog
    python bench/bench_rollout.py [--preset cpu|gpu] [--prompts N] [--min-len A] [--max-len B]
        [--beam 16] [--new-tokens 3] [--items N] [--hf-batch 8] [--skip-hf]

A real `grctl serve` on bench_generate.py's model (preset cpu: the 29M Qwen3; gpu: Qwen3-0.6B's
shape in bf16 on CUDA), saved as a checkpoint, with a catalog of 3-token items. The same prompts
(lengths uniform in [min, max], random tokens) go:
- flood_batch: all at once, one /generate with a list of prompts;
- flood_submit_many: all at once, one /submit_many, then /result for each;
- one_at_a_time: one /generate after another;
- transformers: generate(num_beams, prefix_allowed_tokens_fn over the same catalog), left-padded
  batches of --hf-batch prompts (it prefills each prompt once per beam);
and the FLOP floor: the batch's prefill and decode FLOPs (bench/flops.py: every matmul the
engine must run on every prompt token, causal attention, the head on each prompt's last token;
then per decoded row every matmul and the head, attention over its context) at the matmul rate
this process measures around the runs. Prints one JSON object: seconds, prompts/s, beams/s,
p50/p99 latency (the engine's e2e_latency of each request; the client's wall for one at a
time), the floods' ratios to one at a time (target: at most 1) and to the floor (target: at
most 1.2), and how many top beams agree across the ways.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_catalog import write_catalog  # noqa: E402
from bench.bench_generate import PRESETS, build  # noqa: E402
from bench.flops import prefill_flops, request_flops  # noqa: E402
from grctl.model import dtypes  # noqa: E402
from grctl.model.config import ModelConfig  # noqa: E402
from tests.support.serverproc import running_server  # noqa: E402

FULL = {"prompts": 256, "min_len": 256, "max_len": 2048, "items": 1_000_000}


def matmul_rate(cfg: ModelConfig, device: str, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of the model's largest matmul shape (tokens x hidden @ hidden x 2 * inter)."""
    x = torch.randn(2048, cfg.hidden_size, device=device, dtype=dtype)
    w = torch.randn(cfg.hidden_size, 2 * cfg.intermediate_size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x @ w
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.shape[0] * x.shape[1] * w.shape[1] / best


def floor_flops(cfg: ModelConfig, lens: list[int], beam: int, new_tokens: int) -> dict:
    """The batch's FLOPs at least (bench/flops.py): each prompt's prefill, then its decode
    steps."""
    prefill = sum(prefill_flops(cfg, n) for n in lens)
    whole = sum(request_flops(cfg, n, beam, new_tokens) for n in lens)
    return {"prefill": prefill, "decode": whole - prefill}


def percentiles(xs: list[float]) -> dict:
    a = np.asarray(xs)
    return {f"p{q}_s": round(float(np.percentile(a, q)), 4) for q in (50, 99)}


def beam_ids(reply: dict) -> list[list[int]]:
    return [b["output_ids"] for b in reply["meta_info"]["beam_results"]]


class CatalogFn:
    """prefix_allowed_tokens_fn for transformers: the children of a beam's node in the catalog
    (rows are left-padded prompts of `prompt_width` tokens, then the beam's tokens)."""

    def __init__(self, path: Path):
        children: dict[tuple[int, ...], set[int]] = {}
        for line in path.read_text().splitlines():
            tokens = json.loads(line)["token_ids"]
            for depth in range(len(tokens)):
                children.setdefault(tuple(tokens[:depth]), set()).add(tokens[depth])
        self.children = {k: sorted(v) for k, v in children.items()}
        self.prompt_width = 0

    def __call__(self, batch_id: int, ids: torch.Tensor) -> list[int]:
        return self.children.get(tuple(ids[self.prompt_width :].tolist()), [0])


def run_hf(hf, prompts, catalog: Path, beam: int, new_tokens: int, chunk: int):
    """-> (seconds, each prompt's top beam); the catalog's trie is built before the clock."""
    allowed = CatalogFn(catalog)
    tops, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), chunk):
        part = prompts[i : i + chunk]
        width = allowed.prompt_width = max(map(len, part))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in part], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part], device=hf.device)
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                num_beams=beam,
                num_return_sequences=beam,
                do_sample=False,
                length_penalty=0.0,
                early_stopping=False,
                eos_token_id=None,
                pad_token_id=0,
                prefix_allowed_tokens_fn=allowed,
            )
        tops += out[::beam, width:].tolist()
    return time.perf_counter() - t0, tops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument(
        "--full", action="store_true", help="the target sizes: 256 prompts, beam 16, 1M items"
    )
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--beam", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=3)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    if args.full:
        vars(args).update(FULL)
    preset = PRESETS[args.preset]
    device, dtype = preset["device"], dtypes.SERVED_DTYPES[preset["dtype"]]
    transformers.logging.set_verbosity_error()
    hf, ours = build(preset["shape"], dtype, device)
    cfg = ours.config
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    sp = {"max_new_tokens": args.new_tokens, "n": args.beam}
    sizes = ("preset", "prompts", "min_len", "max_len", "beam", "new_tokens", "items")
    report: dict = {k: getattr(args, k) for k in sizes}
    report["prompt_tokens"] = sum(lens)
    rates = [matmul_rate(cfg, device, dtype)]
    with tempfile.TemporaryDirectory(prefix="grctl-bench-rollout-") as tmp:
        ckpt, catalog = Path(tmp) / "ckpt", Path(tmp) / "catalog.jsonl"
        hf.save_pretrained(ckpt)
        write_catalog(catalog, args.items)
        flags = ["--model-path", str(ckpt), "--catalog", str(catalog), "--device", device,
                 "--max-running-requests", str(max(64, args.prompts)),
                 "--max-http-submit-many", str(args.prompts),
                 "--max-http-request-bytes", str(64 << 20),
                 "--max-context-len", str(args.max_len + args.new_tokens),
                 "--max-beam-width", str(args.beam), "--generate-timeout-s", "36000"]  # fmt: skip
        with (
            running_server(*flags, start_timeout=600) as srv,
            httpx.Client(base_url=srv.url, timeout=36000) as http,
        ):
            http.post("/generate", json={"input_ids": prompts[0][:16], "sampling_params": sp})
            replies, seconds, latency = {}, {}, {}

            # the prefix cache is on (the default); emptied before each way, so no way reuses
            # another's prompts (a trainer's next rollout has new ones)
            http.post("/flush_cache")
            t0 = time.perf_counter()
            batch = http.post("/generate", json={"input_ids": prompts, "sampling_params": sp})
            seconds["flood_batch"] = time.perf_counter() - t0
            replies["flood_batch"] = batch.json()

            http.post("/flush_cache")
            t0 = time.perf_counter()
            body = {"requests": [{"input_ids": p, "sampling_params": sp} for p in prompts]}
            rids = http.post("/submit_many", json=body).json()["request_ids"]
            replies["flood_submit_many"] = [http.get(f"/result/{r}").json() for r in rids]
            seconds["flood_submit_many"] = time.perf_counter() - t0

            http.post("/flush_cache")
            one, walls = [], []
            for p in prompts:
                t1 = time.perf_counter()
                body = {"input_ids": p, "sampling_params": sp}
                one.append(http.post("/generate", json=body).json())
                walls.append(time.perf_counter() - t1)
            seconds["one_at_a_time"] = sum(walls)
            replies["one_at_a_time"] = one
            for name in ("flood_batch", "flood_submit_many"):
                latency[name] = [r["meta_info"]["e2e_latency"] for r in replies[name]]
            latency["one_at_a_time"] = walls
        rates.append(matmul_rate(cfg, device, dtype))
        if not args.skip_hf:
            seconds["transformers"], hf_tops = run_hf(
                hf, prompts, catalog, args.beam, args.new_tokens, args.hf_batch
            )
    rate = max(rates)
    flops = floor_flops(cfg, lens, args.beam, args.new_tokens)
    floor_s = (flops["prefill"] + flops["decode"]) / rate
    report["floor"] = {
        "matmul_gflops": round(rate / 1e9, 1),
        "prefill_gflop": round(flops["prefill"] / 1e9, 1),
        "decode_gflop": round(flops["decode"] / 1e9, 1),
        "seconds": round(floor_s, 3),
    }
    for name, s in seconds.items():
        row = {
            "seconds": round(s, 3),
            "prompts_per_s": round(args.prompts / s, 2),
            "beams_per_s": round(args.prompts * args.beam / s, 1),
            "vs_floor": round(s / floor_s, 3),
        }
        if name in latency:
            row.update(percentiles(latency[name]))
        if name in replies:
            row["cached_tokens"] = sum(r["meta_info"]["cached_tokens"] for r in replies[name])
        report[name] = row
    for name in ("flood_batch", "flood_submit_many"):
        report[name]["vs_one_at_a_time"] = round(seconds[name] / seconds["one_at_a_time"], 3)
    tops = {name: [beam_ids(r)[0] for r in rs] for name, rs in replies.items()}
    report["top_beams_equal_to_flood_batch"] = {
        name: sum(a == b for a, b in zip(t, tops["flood_batch"], strict=True))
        for name, t in tops.items()
    }
    if not args.skip_hf:
        report["top_beams_equal_to_flood_batch"]["transformers"] = sum(
            a == b for a, b in zip(hf_tops, tops["flood_batch"], strict=True)
        )
    report["targets"] = {
        "flood_not_slower_than_one_at_a_time": all(
            report[n]["vs_one_at_a_time"] <= 1.0 for n in ("flood_batch", "flood_submit_many")
        ),
        "flood_within_1.2x_floor": all(
            report[n]["vs_floor"] <= 1.2 for n in ("flood_batch", "flood_submit_many")
        ),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
