"""Item catalog: build time and resident memory, and what the constraint costs a beam search.

1. A catalog of --items items (default 1,000,000), each a 3-token path over 3 x 8,192 codes, is
   written as JSONL, then parsed and built into the trie (grctl.catalog.store.build_catalog):
   wall and CPU seconds, and the process's resident memory growth per item (RSS after the build
   minus RSS before, the parse's freed heap handed back) beside the bytes the trie reports.
2. bench_generate's cpu preset model (29M parameters, vocab 8,192): one request of prompt 512,
   beam 64, 3 new tokens, with the catalog (use_catalog true) and without it, runs alternating,
   best of --repeats (wall and CPU), and the ratio constrained / unconstrained.

    python bench/bench_catalog.py [--items 1000000] [--repeats 5] [--skip-generate]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_generate import PRESETS, build, interleaved  # noqa: E402
from grctl.catalog.store import CatalogStore, build_catalog  # noqa: E402
from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.engine import Engine  # noqa: E402
from grctl.engine.request import GenerateRequest, SamplingParams  # noqa: E402

CODES = 8192
DEPTH = 3


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def trim_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def write_catalog(path: Path, num_items: int, seed: int = 0) -> None:
    codes = np.random.default_rng(seed).integers(0, CODES, (num_items, DEPTH))
    lines = (
        f'{{"item_id": {i}, "token_ids": [{a}, {b}, {c}]}}'
        for i, (a, b, c) in enumerate(codes.tolist())
    )
    path.write_text("\n".join(lines) + "\n")


def measure_build(path: Path, num_items: int) -> dict:
    trim_heap()
    before = rss_bytes()
    w0, c0 = time.perf_counter(), time.process_time()
    catalog = build_catalog(str(path), 1, torch.device("cpu"), vocab_size=CODES)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    trim_heap()
    grown = rss_bytes() - before
    status = catalog.status()
    return {
        "items": num_items,
        "file_mb": round(path.stat().st_size / 1e6, 1),
        "build_s": round(wall, 3),
        "build_cpu_s": round(cpu, 3),
        "rss_bytes_per_item": round(grown / num_items, 1),
        "trie_bytes_per_item": round(catalog.nbytes / num_items, 1),
        "num_nodes": status["num_nodes"],
        "num_paths": status["num_paths"],
        "target_build_s": 3.0,
        "target_bytes_per_item": 100,
    }


def measure_generate(path: Path, repeats: int, width: int = 64) -> dict:
    preset = PRESETS["cpu"]
    transformers.logging.set_verbosity_error()
    _, ours = build(preset["shape"], torch.float32, "cpu")
    engine = Engine(ours, EngineConfig(device="cpu", max_new_tokens=3, max_beam_width=width))
    engine.catalogs = CatalogStore(torch.device("cpu"), preset["shape"]["vocab_size"])
    engine.catalogs.load(str(path))
    engine.start()
    gen = torch.Generator().manual_seed(1)
    ids = tuple(torch.randint(0, CODES, (preset["prompt_len"],), generator=gen).tolist())

    def run(use_catalog: bool):
        sp = SamplingParams(max_new_tokens=3, n=width, use_catalog=use_catalog)
        return engine.generate(GenerateRequest(ids, sp))

    times, outs = interleaved({"free": lambda: run(False), "catalog": lambda: run(True)}, repeats)
    engine.stop()
    free, cat = times["free"], times["catalog"]
    complete = all(r.is_complete for r in outs["catalog"].item_results)
    return {
        "prompt_tokens": preset["prompt_len"],
        "beam": width,
        "new_tokens": 3,
        "repeats": repeats,
        "unconstrained_ms": round(min(free["wall"]) * 1e3, 1),
        "constrained_ms": round(min(cat["wall"]) * 1e3, 1),
        "ratio": round(min(cat["wall"]) / min(free["wall"]), 3),
        "unconstrained_cpu_ms": round(min(free["cpu"]) * 1e3, 1),
        "constrained_cpu_ms": round(min(cat["cpu"]) * 1e3, 1),
        "ratio_cpu": round(min(cat["cpu"]) / min(free["cpu"]), 3),
        "beams_returned": len(outs["catalog"].beams),
        "all_beams_are_items": complete,
        "target_ratio": 1.15,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-generate", action="store_true")
    args = parser.parse_args()
    report: dict = {"threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="grctl-bench-catalog-") as tmp:
        path = Path(tmp) / "catalog.jsonl"
        write_catalog(path, args.items)
        report["build"] = measure_build(path, args.items)
        if not args.skip_generate:
            report["generate"] = measure_generate(path, args.repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
