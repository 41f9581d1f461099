"""Delta sync against full syncs on a real `grctl serve` (CPU), one run, one server.

    python bench/bench_delta_sync.py [--fraction 0.02] [--repeats 3] [--layers 8]

A random bf16 checkpoint (hidden 1024, vocab 32768, untied head, --layers layers; about 0.5 GB
at 8) is served. Each round is one training step that moves `--fraction` of the elements of
every tensor (the rest stay bit-identical), synced three ways in turn, each from the state the
last left:

- delta: DeltaPublisher.publish (this process diffs against its snapshot and writes the changed
  positions and values, encoding `sparse`) then POST /pull_weights (the server reads the delta,
  decodes it into copies of its tensors, checks every final-state checksum, copies them in);
- full_disk: the new state written as a checkpoint beforehand (not timed), then POST
  /update_weights_from_disk (the server reads every byte);
- full_push: GRClient.push_tensors of the new state (shared-memory buckets, every byte).

Bytes moved: the delta's files against the model's bytes. The floor (floor_of) is measured
on the last delta's own bytes: xxh3-128 over the tensors it changes, one memcpy of its payload,
zstd's decompression of it; `pull_over_floor` is the median pull over the checksum + memcpy.
After each delta, three tensors are read back and compared with the step's own tensors.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safetensors.torch import load_file, save_file  # noqa: E402

from bench.common import write_random_checkpoint  # noqa: E402
from grctl.client import GRClient  # noqa: E402
from grctl.client.delta import DeltaPublisher, pull_weights  # noqa: E402
from grctl.model.config import ModelConfig  # noqa: E402
from tests.support.serverproc import running_server  # noqa: E402

READ_BACK = ("model.norm.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight")


def load_state(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def step(state: dict, fraction: float, gen: torch.Generator) -> dict:
    new = {}
    for name, t in state.items():
        flat = t.clone().reshape(-1)
        k = max(1, int(fraction * flat.numel()))
        idx = torch.randint(0, flat.numel(), (k,), generator=gen)
        flat[idx] = (flat[idx].float() + 0.001 * torch.randn(k, generator=gen)).to(t.dtype)
        new[name] = flat.reshape(t.shape)
    return new


def check_served(http: httpx.Client, state: dict) -> None:
    for name in READ_BACK:
        r = http.post("/get_weights_by_name", json={"name": name, "truncate_size": 10**6})
        got = torch.tensor(r.json()["parameter"], dtype=torch.float32)
        assert torch.equal(got, state[name].float()), f"{name} differs after the sync"


def best_s(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def floor_of(state: dict, deltas: Path, version: int) -> dict:
    """What a delta's apply cannot skip, on the last delta's own bytes: a checksum (xxh3-128,
    the publisher's default) over every byte of the tensors it changes, one memcpy of its
    payload bytes, and zstd's decompression of them (compressed here once, at level 3)."""
    import numpy as np
    import xxhash
    import zstandard

    from grctl.weights.delta import version_dir

    f = version_dir(deltas, version) / "model-00000-of-00001.safetensors"
    payload = np.concatenate([t.reshape(-1) for t in load_file(str(f)).values()])
    packed = zstandard.ZstdCompressor(level=3).compress(payload.tobytes())
    flat = [t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in state.values()]
    hash_s = best_s(lambda: [xxhash.xxh3_128(memoryview(b)).hexdigest() for b in flat])
    copy_s = best_s(lambda: payload.copy())
    unzstd_s = best_s(lambda: zstandard.ZstdDecompressor().decompress(packed))
    nbytes = sum(b.size for b in flat)
    return {
        "xxh3_s": round(hash_s, 4),
        "xxh3_gb_per_s": round(nbytes / hash_s / 1e9, 2),
        "payload_memcpy_s": round(copy_s, 5),
        "zstd_bytes": len(packed),
        "zstd_decompress_s": round(unzstd_s, 4),
        "zstd_decompress_gb_per_s": round(payload.size / unzstd_s / 1e9, 2),
        "s": round(hash_s + copy_s, 4),  # uncompressed (the publisher's): checksum + copy
    }


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fraction", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=1024,
        num_attention_heads=16,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=3072,
        vocab_size=32768,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="grctl-delta-bench-") as tmp:
        root = Path(tmp)
        nbytes = write_random_checkpoint(root / "base", cfg)
        state = load_state(root / "base")
        serve = ("--allow-weight-update", "--model-path", str(root / "base"))
        serve += ("--weights-root", str(root), "--weight-version", "0")
        with running_server(*serve) as srv, srv.client(timeout=600) as http:
            client = GRClient(srv.url)
            pub = DeltaPublisher(root / "deltas")
            runs: dict[str, list[dict]] = {"delta": [], "full_disk": [], "full_push": []}
            version = 0
            for _ in range(args.repeats):
                # delta
                pub.snapshot(state, version)
                state = step(state, args.fraction, gen)
                stats = pub.publish(state)
                t0 = time.perf_counter()
                reply = pull_weights(srv.url, root / "deltas", stats.version)
                pull_s = time.perf_counter() - t0
                version = stats.version
                check_served(http, state)
                runs["delta"].append(
                    {
                        "publish_s": stats.elapsed_ms / 1000,
                        "pull_s": pull_s,
                        "server_ms": reply["elapsed_ms"],
                        "wire_bytes": stats.wire_bytes,
                        "changed_tensor_bytes": stats.changed_bytes,
                    }
                )
                # full sync from disk
                state = step(state, args.fraction, gen)
                version += 1
                ck = root / f"full-{version}"
                ck.mkdir()
                save_file(state, str(ck / "model.safetensors"))
                (ck / "config.json").write_text((root / "base" / "config.json").read_text())
                t0 = time.perf_counter()
                r = http.post(
                    "/update_weights_from_disk",
                    json={"model_path": str(ck), "weight_version": version},
                )
                assert r.status_code == 200, r.text
                runs["full_disk"].append({"s": time.perf_counter() - t0, "bytes": nbytes})
                check_served(http, state)
                # full push of tensors
                state = step(state, args.fraction, gen)
                version += 1
                t0 = time.perf_counter()
                client.push_tensors(state, weight_version=version, flush_cache=True)
                runs["full_push"].append({"s": time.perf_counter() - t0, "bytes": nbytes})
                check_served(http, state)
            floor = floor_of(state, root / "deltas", stats.version)
    d = runs["delta"]
    out = {
        "model_bytes": nbytes,
        "fraction_of_elements_changed": args.fraction,
        "repeats": args.repeats,
        "delta": {
            "wire_bytes": med([r["wire_bytes"] for r in d]),
            "wire_fraction_of_model": round(med([r["wire_bytes"] for r in d]) / nbytes, 4),
            "publish_s_median": med([r["publish_s"] for r in d]),
            "pull_s_median": med([r["pull_s"] for r in d]),
            "server_ms_median": med([r["server_ms"] for r in d]),
            "publish_plus_pull_s_median": med([r["publish_s"] + r["pull_s"] for r in d]),
        },
        "full_disk": {"bytes": nbytes, "s_median": med([r["s"] for r in runs["full_disk"]])},
        "full_push": {"bytes": nbytes, "s_median": med([r["s"] for r in runs["full_push"]])},
        "floor": floor,
        "pull_over_floor": round(med([r["pull_s"] for r in d]) / floor["s"], 2),
        "runs": runs,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
