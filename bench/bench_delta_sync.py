"""Delta syncs against full syncs on a real `grctl serve` (CPU), one run, one server.

    python bench/bench_delta_sync.py [--fractions 0.005,0.02,0.033] [--repeats 3] [--layers 1]

A random bf16 checkpoint (hidden 1024, vocab 32768, untied head, --layers layers; 159 MB at 1)
is served. Each round is one training step that moves a fraction of the elements of every
tensor (the rest stay bit-identical), synced three ways in turn, each from the state the last
left, each timed from pause to continue (POST /pause_generation abort, the sync,
/continue_generation), the way a trainer's WeightSync holds the server:

- delta: DeltaPublisher.publish first, while the server serves (the trainer diffs against its
  snapshot and writes the changed positions and values, encoding `sparse`, xxh3-128); in the
  pause, POST /pull_weights (the paused server patches each tensor in place and hashes it in one
  pass, delta_patch.patch_checked);
- full_disk: the new state written as a checkpoint first (timed apart, outside the pause), then
  POST /update_weights_from_disk in the pause (the server reads every byte, page-cached);
- full_push: GRClient.push_tensors of the new state in the pause (shared-memory buckets).

After each sync three tensors read back equal the step's own. Then, on the last fraction's last
delta, where its time goes (`parts`, in this process on the same tensors, best of 3): reading
and parsing the delta file, zstd's decompression of its payload (miles publishes zstd), the
check-first checksum (served bytes patched chunk by chunk in a buffer: a serving engine's way),
the scatter alone, the one-pass patch+hash; and miles' form on the server: the pull into a
`local_checkpoint_dir` (the changed safetensors files rewritten) and the whole-model
/update_weights_from_disk reload it needs. The floor, on the same bytes: xxh3-128 over every
changed tensor plus one memcpy of the changed bytes; `pull_over_floor` is the median delta
pause-to-continue over it. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from bench.common import write_random_checkpoint  # noqa: E402
from grctl.client import GRClient  # noqa: E402
from grctl.client.delta import DeltaPublisher  # noqa: E402
from grctl.model.config import ModelConfig  # noqa: E402
from grctl.weights import delta_patch  # noqa: E402
from grctl.weights.delta import version_dir  # noqa: E402
from tests.support.serverproc import running_server  # noqa: E402

READ_BACK = ("model.norm.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight")
DELTA_FILE = "model-00000-of-00001.safetensors"


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


def paused(http: httpx.Client, sync) -> float:
    """Seconds from the pause to the continue, `sync()` between them."""
    t0 = time.perf_counter()
    r = http.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200, r.text
    sync()
    r = http.post("/continue_generation", json={})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def paused_call(http: httpx.Client, route: str, body: dict) -> tuple[float, float]:
    """(pause to continue, the server's own elapsed) of one update call in a pause."""
    reply: dict = {}
    s = paused(http, lambda: reply.update(ok(http.post(route, json=body))))
    return s, reply["elapsed_ms"] / 1000


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def best_s(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def parts_of(old: dict, vdir: Path) -> dict:
    """Where the last delta's apply goes, on the same tensors in this process (best of 3):
    read + parse, zstd decompression of its payload, the check-first checksum, the scatter
    alone, the one-pass patch+hash; and the floor on the same bytes."""
    import xxhash
    import zstandard

    with safe_open(str(vdir / DELTA_FILE), framework="np") as st:
        sums = st.metadata()
        names = list(st.keys())

    def read_parse() -> dict:
        out = {}
        with safe_open(str(vdir / DELTA_FILE), framework="np") as st:
            for n in names:
                t = old[n]
                payload = st.get_tensor(n)
                out[n] = delta_patch.parse(n, "sparse", payload, t.numel() * 2, t.element_size())
        return out

    patches = read_parse()
    bases = {n: delta_patch.host_bytes(old[n]) for n in names}
    payload = np.concatenate([load_file(str(vdir / DELTA_FILE))[n].numpy() for n in names])
    packed = zstandard.ZstdCompressor(level=3).compress(payload.tobytes())
    changed = np.concatenate(
        [np.ascontiguousarray(p.values).view(np.uint8) for p in patches.values()]
    )

    def one_pass() -> None:  # on copies, so each repeat starts from the base again
        for n in names:
            live = bases[n].copy()
            t0 = time.perf_counter()
            got, _ = delta_patch.patch_checked("xxh3-128", live, patches[n])
            one_pass.s += time.perf_counter() - t0
            assert got == sums[n], n

    def scatter() -> None:
        for n in names:
            live = torch.from_numpy(bases[n].copy())
            t0 = time.perf_counter()
            delta_patch.write(live, patches[n])
            scatter.s += time.perf_counter() - t0

    def timed_inner(fn) -> float:
        best = float("inf")
        for _ in range(3):
            fn.s = 0.0
            fn()
            best = min(best, fn.s)
        return best

    hash_s = best_s(lambda: [xxhash.xxh3_128(memoryview(bases[n])).digest() for n in names])
    copy_s = best_s(lambda: changed.copy())
    nbytes = sum(b.size for b in bases.values())
    return {
        "changed_tensor_bytes": nbytes,
        "changed_element_bytes": int(changed.size),
        "read_parse_s": round(best_s(read_parse), 4),
        "payload_bytes": int(payload.size),
        "zstd_bytes": len(packed),
        "zstd_decompress_s": round(
            best_s(lambda: zstandard.ZstdDecompressor().decompress(packed)), 4
        ),
        "check_first_checksum_s": round(
            best_s(
                lambda: [
                    delta_patch.checksum_after("xxh3-128", bases[n], patches[n]) for n in names
                ]
            ),
            4,
        ),
        "scatter_s": round(timed_inner(scatter), 4),
        "one_pass_patch_hash_s": round(timed_inner(one_pass), 4),
        "floor": {
            "xxh3_s": round(hash_s, 4),
            "xxh3_gb_per_s": round(nbytes / hash_s / 1e9, 2),
            "changed_bytes_memcpy_s": round(copy_s, 5),
            "zstd_decompress_gb_per_s": None,  # filled below
            "s": round(hash_s + copy_s, 4),
        },
    }


def miles_form(http: httpx.Client, root: Path, base: dict, fraction: float, gen) -> dict:
    """miles' disk-delta form: seed a local checkpoint (version 0: the served base), publish a
    step against the base, pull it into the local dir (its safetensors files rewritten), then
    the whole-model reload miles follows it with; both in one pause."""
    local, src = root / "local", root / "miles"
    ok(http.post("/pull_weights", json={"source_dir": str(src), "target_version": 0,
                                         "local_checkpoint_dir": str(local)}))  # fmt: skip
    pub = DeltaPublisher(src)
    pub.snapshot(base, 0)
    new = step(base, fraction, gen)
    stats = pub.publish(new)
    out = {}

    def sync() -> None:
        t0 = time.perf_counter()
        body = {"source_dir": str(src), "target_version": stats.version,
                "local_checkpoint_dir": str(local)}  # fmt: skip
        ok(http.post("/pull_weights", json=body))
        t1 = time.perf_counter()
        ok(http.post("/update_weights_from_disk", json={"model_path": str(local)}))
        out["local_write_s"], out["disk_reload_s"] = t1 - t0, time.perf_counter() - t1

    out["pause_to_continue_s"] = paused(http, sync)
    check_served(http, new)
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fractions", default="0.005,0.02,0.033")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
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
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="grctl-delta-bench-") as tmp:
        root = Path(tmp)
        nbytes = write_random_checkpoint(root / "base", cfg)
        base = state = load_state(root / "base")
        serve = ("--allow-weight-update", "--model-path", str(root / "base"))
        serve += ("--weights-root", str(root), "--weight-version", "0")
        with running_server(*serve) as srv, srv.client(timeout=600) as http:
            client = GRClient(srv.url)
            pub = DeltaPublisher(root / "deltas")
            version, results = 0, []
            for fraction in fractions:
                runs: dict[str, list[dict]] = {"delta": [], "full_disk": [], "full_push": []}
                for _ in range(args.repeats):
                    pub.snapshot(state, version)
                    before, state = state, step(state, fraction, gen)
                    stats = pub.publish(state)
                    version = stats.version
                    body = {"source_dir": str(root / "deltas"), "target_version": version}
                    s, server_s = paused_call(http, "/pull_weights", body)
                    check_served(http, state)
                    publish_s, wire = stats.elapsed_ms / 1000, stats.wire_bytes
                    runs["delta"].append({"pause_to_continue_s": s, "server_s": server_s,
                                          "publish_s": publish_s, "wire_bytes": wire})  # fmt: skip
                    last = (before, version_dir(root / "deltas", version))
                    state = step(state, fraction, gen)
                    version += 1
                    ck = root / f"full-{version}"
                    ck.mkdir()
                    t0 = time.perf_counter()
                    save_file(state, str(ck / "model.safetensors"))
                    write_s = time.perf_counter() - t0
                    (ck / "config.json").write_text((root / "base" / "config.json").read_text())
                    body = {"model_path": str(ck), "weight_version": version}
                    s, server_s = paused_call(http, "/update_weights_from_disk", body)
                    check_served(http, state)
                    runs["full_disk"].append({"pause_to_continue_s": s, "server_s": server_s,
                                              "checkpoint_write_s": write_s})  # fmt: skip
                    state = step(state, fraction, gen)
                    version += 1
                    s = paused(
                        http,
                        lambda v=version, st=state: client.push_tensors(
                            st, weight_version=v, flush_cache=True
                        ),
                    )
                    check_served(http, state)
                    runs["full_push"].append({"pause_to_continue_s": s})
                    for f in ck.iterdir():
                        f.unlink()
                    ck.rmdir()
                p2c = {k: med([r["pause_to_continue_s"] for r in v]) for k, v in runs.items()}
                wire = med([r["wire_bytes"] for r in runs["delta"]])
                results.append({
                    "fraction_of_elements_changed": fraction,
                    "delta_wire_bytes": wire,
                    "delta_wire_fraction_of_model": round(wire / nbytes, 4),
                    "pause_to_continue_s_median": p2c,
                    "server_s_median": {k: med([r["server_s"] for r in runs[k]])
                                        for k in ("delta", "full_disk")},  # fmt: skip
                    "delta_over_full_disk": round(p2c["delta"] / p2c["full_disk"], 2),
                    "delta_over_full_push": round(p2c["delta"] / p2c["full_push"], 2),
                    "publish_s_median": med([r["publish_s"] for r in runs["delta"]]),
                    "checkpoint_write_s_median": med(
                        [r["checkpoint_write_s"] for r in runs["full_disk"]]
                    ),
                    "runs": runs,
                })  # fmt: skip
            parts = parts_of(*last)
            parts["floor"]["zstd_decompress_gb_per_s"] = round(
                parts["payload_bytes"] / max(parts["zstd_decompress_s"], 1e-9) / 1e9, 2
            )
            miles = miles_form(http, root, base, fractions[-1], gen)
    last_delta = results[-1]["pause_to_continue_s_median"]["delta"]
    out = {
        "model_bytes": nbytes,
        "repeats": args.repeats,
        "load_average_before_after": [round(x, 2) for x in (*load_before[:1], os.getloadavg()[0])],
        "results": results,
        "parts_last_fraction": parts,
        "pull_over_floor_last_fraction": round(last_delta / parts["floor"]["s"], 2),
        "miles_local_checkpoint_form": miles,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
