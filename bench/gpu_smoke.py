"""The GPU checks in one run (at most 6.5 minutes on one H200), JSON to $OUT/gpu_smoke.json, and
one report printed at the end (every section's figures beside its target and reference).

    python bench/gpu_smoke.py                 # on the CUDA machine (bench/gpu_check.sh calls it)
    python bench/gpu_smoke.py --dry-run       # CPU, tiny shapes: checks the script end to end

Sections, each timed, each failure recorded without stopping the others:
- tests: the gpu-marked tests (pytest -m gpu);
- graphs: CUDA-graph decode against eager decode on a mixed batch (widths 4, 3, 20, 1), then
  again after an in-place weight update; the replay count grows and the outputs move with the
  weights, so the graphs replay real work; the decode's time through graphs against eager;
- parity: greedy and beam-8 outputs on the device equal to the same float32 weights on the CPU;
- generate: Qwen3-1.7B and 8B shapes, random bf16 weights built in place, prompt 5000, beam 256,
  3 new tokens, 1 and 8 requests (req/s of the 8; target 35 for 1.7B on one H200): CUDA-event
  times of each prefill and decode call, peak memory,
  a profiler top-10; transformers' prefill of the same prompt beside (its beam search at 256
  would copy the context KV per beam: more than the GPU holds);
- ipc_1.7b, ipc_8b: a colocated CUDA IPC sync as a trainer runs it: this process pauses its
  engine (in_place), a child stages the model's weights in 512 MiB CUDA buckets and sends the
  payloads, this process applies them through the weight sink, then continues; pause to
  continue timed (target under 1 s for 8B), checksums, times against a device-to-device copy
  of the same bytes, memory back to baseline on both sides;
- disk: the 0.6B checkpoint loaded by /update_weights_from_disk's path from the page cache;
- decode_mix: the two mixed decode batches as one step (Qwen3-0.6B shape, bf16, through
  CUDA graphs) against their requests alone and by groups (bench/bench_decode_mix.py);
- prefix_cache: 16 prompts sharing 1,792 of 2,048 tokens (Qwen3-0.6B shape, bf16), with the
  prefix cache against without it, same beams (bench/bench_prefix_cache.py; target 0.3x);
- memory: release/resume_memory_occupation on the 0.6B shape (bench/bench_memory.py): device
  memory before, released and resumed, times against a plain copy of the weights to pinned host
  memory and back, graphs captured again, beam outputs equal after the resume.
Every ratio is printed beside the reference measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_decode_mix import gpu_part as decode_mix_part  # noqa: E402
from bench.bench_memory import memory_part  # noqa: E402
from bench.bench_prefix_cache import measure as prefix_cache_measure  # noqa: E402
from bench.gpu_smoke_parts import (  # noqa: E402
    SHAPES,
    disk_part,
    generate_part,
    graphs_part,
    ipc_child,
    ipc_part,
    parity_part,
)

BUDGET_S = 390.0  # with gpu_check.sh's other steps, the whole script in under 8 minutes


def tests_part(dry_run: bool, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider"]
    if dry_run:
        cmd.append("--collect-only")
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {
        "returncode": done.returncode,
        "summary": lines[-1] if lines else "",
        "tail": lines[-15:],
        "seconds": round(time.monotonic() - t0, 1),
    }


def prefix_cache_part(dry_run: bool) -> dict:
    if dry_run:  # the CPU preset at tiny sizes: the script end to end
        return prefix_cache_measure("cpu", 4, 64, 48, beam=2, repeats=1)
    return prefix_cache_measure("gpu")


def report_text(report: dict) -> str:
    """The one report: every section's figures against their targets, its errors, its time."""
    lines = [f"==== GPU report: {report['device']}, torch {report['torch']} ===="]
    for name, result in report["sections"].items():
        head = f"[{name}] {result.get('section_seconds', '-')} s"
        if "skipped" in result or "error" in result:
            head += f": {result.get('skipped') or 'ERROR ' + result['error']}"
        lines.append(head)
        lines += [f"    {line}" for line in result.get("ratios", [])]
        if name == "tests":
            lines.append(f"    {result.get('summary', '')}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, seconds")
    ap.add_argument("--only", nargs="*", help="run only these sections")
    ap.add_argument("--ipc-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ipc-shape", default="1.7b", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ipc_child:
        return ipc_child(args.dry_run, args.ipc_shape)
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="grctl-gpu-smoke-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 1
    deadline = time.monotonic() + BUDGET_S
    report: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "sections": {},
    }
    shapes = ["tiny"] if args.dry_run else ["1.7b", "8b"]
    sections = [
        ("tests", lambda: tests_part(args.dry_run, min(150.0, deadline - time.monotonic()))),
        ("graphs", lambda: graphs_part(device)),
        ("parity", lambda: parity_part(device)),
        ("decode_mix", lambda: decode_mix_part(device, args.dry_run)),
        ("prefix_cache", lambda: prefix_cache_part(args.dry_run)),
        *[
            (f"generate_{s}", lambda s=s: generate_part(device, SHAPES[s], args.dry_run))
            for s in shapes
        ],
        *[(f"ipc_{s}", lambda s=s: ipc_part(device, s, args.dry_run, deadline)) for s in shapes],
        ("disk", lambda: disk_part(device, args.dry_run)),
        (
            "memory",
            lambda: memory_part(
                device, "tiny" if args.dry_run else "0.6b", repeats=1 if args.dry_run else 2
            ),
        ),
    ]
    for name, run in sections:
        if args.only and name not in args.only:
            continue
        left = deadline - time.monotonic()
        if left < 20:
            report["sections"][name] = {"skipped": f"out of time ({left:.0f} s left)"}
            continue
        t0 = time.monotonic()
        try:
            result = run()
        except Exception as exc:  # one section's failure must not hide the others' figures
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["section_seconds"] = round(time.monotonic() - t0, 1)
        report["sections"][name] = result
        for line in result.get("ratios", []):
            print(f"[{name}] {line}", flush=True)
        if "error" in result:
            print(f"[{name}] ERROR {result['error']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        (out_dir / "gpu_smoke.json").write_text(json.dumps(report, indent=2, default=str))
    print(report_text(report), flush=True)
    print(f"wrote {out_dir / 'gpu_smoke.json'}", flush=True)
    return 0 if all("error" not in s for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
