"""Weight sync on a real `grctl serve` (CPU): disk update, empty sync window, tensor push.

    python bench/bench_weight_sync.py [--part all|disk|window|tensor] [--repeats 4] [--cycles 200]

One server (--allow-weight-update, --device cpu) serves a ~1.08 GB bf16 checkpoint A; a second
one, B, has the same structure and another seed. Both sit in the page cache. Updates alternate
B, A, B, ... so each one changes every weight, and after each a few tensors are read back
through /get_weights_by_name and compared with the checkpoint just loaded (a no-op cannot pass).

- disk: POST /update_weights_from_disk; the server's elapsed_ms and the client's wall time, the
  server's RssAnon sampled every ms during the call (peak - before).
- window: pause_generation -> flush_cache (200) -> continue_generation on the idle server.
- tensor: a separate client process (bench/weight_push.py) stages each model into 512 MiB
  shared-memory buckets and sends one update_weights_from_tensor call per bucket; staging and
  the calls are timed apart. One more push goes through WeightSync.run, the pipelined product path.
- sync: pause to verified continue of WeightSync.run (what `grctl push` runs): a checkpoint in a
  fresh client process (auto: this host's server reads it itself), the staged shared-memory
  push's steady state (one client process, repeated), and a grctl.rl Arena pushed in place.
- small: an RL loop's sync of a small model (about 15 MB, float32) from this process's memory,
  as a state dict and from an Arena, repeated; beside the empty window and a memcpy of its bytes.

The reference is a plain memcpy (torch copy_) of tensors of the checkpoint's sizes in this
process, measured between the updates with the server's thread count and with one thread; the
faster is the reference (on a shared 2-core machine two-thread copies can be several times
slower). Ratios are best over best and median over median; `checks` judges the targets on
best-of, and the load average beside them says how busy the machine was. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    ONE_GIB_CONFIG,
    PeakRss,
    hf_shapes,
    memcpy_seconds,
    read_through,
    rss_anon_bytes,
    write_random_checkpoint,
)
from bench.weight_push import reads_back  # noqa: E402
from grctl.client import GRClient  # noqa: E402
from grctl.model import dtypes  # noqa: E402
from grctl.model.config import ModelConfig  # noqa: E402
from grctl.weights.checkpoint import Checkpoint  # noqa: E402
from tests.support.serverproc import REPO_ROOT, running_server  # noqa: E402

PARTS = ("disk", "window", "tensor", "sync", "small")
# (part, key, sub-key or None, at most): the CPU targets of disk and tensor updates, on best-of.
TARGETS = (
    ("disk", "ratio_server_vs_memcpy", "best", 1.5),
    ("disk", "ratio_wall_vs_memcpy", "best", 1.5),
    ("disk", "rss_anon_growth_frac_max", None, 0.10),
    ("window", "p50_ms", None, 20.0),
    ("window", "p99_ms", None, 20.0),
    ("tensor", "ratio_calls_wall_vs_memcpy", "best", 2.0),
    ("tensor", "ratio_calls_server_vs_memcpy", "best", 2.0),
    ("sync", "grctl_push_fresh_ratio", "best", 3.0),
    ("sync", "shm_steady_ratio", "best", 2.0),
    ("sync", "arena_steady_ratio", "best", 2.0),
    ("small", "arena_fixed_ms", "best", 30.0),
)


def checks(out: dict) -> dict:
    """Each target that applies to the parts run: its value, its bound, and whether it is met."""
    result = {}
    for part, key, sub, bound in TARGETS:
        if part in out:
            value = out[part][key] if sub is None else out[part][key][sub]
            name = f"{part}.{key}" + (f".{sub}" if sub else "")
            result[name] = {"value": value, "at_most": bound, "met": value <= bound}
    return result


def best_median(values: list[float]) -> dict:
    return {"best": round(min(values), 4), "median": round(statistics.median(values), 4)}


class Memcpy:
    """memcpy of the checkpoint's bytes, measured between updates, with the server's thread
    count and with one thread: on a loaded 2-core machine torch's two-thread copy can be several
    times slower than one thread, so the reference is whichever is faster."""

    def __init__(self) -> None:
        dtype = dtypes.SERVED_DTYPES[ONE_GIB_CONFIG.torch_dtype]
        self.dst = [torch.zeros(s, dtype=dtype) for s in hf_shapes(ONE_GIB_CONFIG).values()]
        self.threads = torch.get_num_threads()
        self.times: dict[int, list[float]] = {self.threads: [], 1: []}

    def measure(self) -> None:
        for n in self.times:
            torch.set_num_threads(n)
            self.times[n].append(memcpy_seconds(self.dst, repeats=2))
        torch.set_num_threads(self.threads)

    def reference(self) -> dict:
        """best and median of the faster thread count."""
        stats = [best_median(t) for t in self.times.values()]
        return {k: min(s[k] for s in stats) for k in ("best", "median")}

    def report(self) -> dict:
        return {f"threads_{n}": best_median(t) for n, t in self.times.items()}


def ensure_checkpoint(path: Path, seed: int) -> int:
    if not (path / "config.json").exists():
        write_random_checkpoint(path, ONE_GIB_CONFIG, seed=seed)
    read_through(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def ratio(num: dict, den: dict) -> dict:
    return {k: round(num[k] / den[k], 2) for k in ("best", "median")}


def disk_part(srv, ckpts: list[Path], nbytes: int, repeats: int, memcpy: Memcpy) -> dict:
    elapsed, wall, growth, mismatches = [], [], [], []
    pid = srv.proc.pid
    before_all = rss_anon_bytes(pid)
    with GRClient(srv.url) as client:
        for i in range(repeats):
            path = ckpts[(i + 1) % 2]  # B first: the server starts on A
            read_through(path)
            memcpy.measure()
            with PeakRss(pid) as rss:
                t0 = time.perf_counter()
                reply = client.update_weights_from_disk(str(path), weight_version=f"disk-{i}")
                wall.append(time.perf_counter() - t0)
            elapsed.append(reply.elapsed_ms / 1e3)
            growth.append(rss.growth)
            with Checkpoint(path) as ckpt:
                mismatches += reads_back(client, ckpt)
        memcpy.measure()
    best = memcpy.reference()
    server, client_wall = best_median(elapsed), best_median(wall)
    return {
        "checkpoint_bytes": nbytes,
        "num_tensors": reply.tensors_loaded,
        "repeats": repeats,
        "server_elapsed_s": server,
        "client_wall_s": client_wall,
        "memcpy_s": memcpy.report(),
        "memcpy_reference_s": best,
        "memcpy_gbps_best": round(nbytes / best["best"] / 1e9, 2),
        "server_gbps_best": round(nbytes / server["best"] / 1e9, 2),
        "ratio_server_vs_memcpy": ratio(server, best),
        "ratio_wall_vs_memcpy": ratio(client_wall, best),
        "rss_anon_growth_bytes": {"max": max(growth), "median": int(statistics.median(growth))},
        "rss_anon_growth_frac_max": round(max(growth) / nbytes, 4),
        "rss_anon_retained_bytes": rss_anon_bytes(pid) - before_all,
        "read_back_mismatches": mismatches,
    }


def window_part(srv, cycles: int) -> dict:
    per_call: dict[str, list[float]] = {"pause": [], "flush": [], "continue": []}
    totals = []
    with GRClient(srv.url) as client:
        client.flush_cache()  # warm the connection and the routes
        for _ in range(cycles):
            t0 = time.perf_counter()
            client.pause_generation()
            t1 = time.perf_counter()
            client.flush_cache()  # raises unless 200
            t2 = time.perf_counter()
            client.continue_generation()
            t3 = time.perf_counter()
            totals.append(t3 - t0)
            for key, dt in zip(per_call, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                per_call[key].append(dt)
    ordered = sorted(totals)
    return {
        "cycles": cycles,
        "p50_ms": round(statistics.median(totals) * 1e3, 3),
        "p99_ms": round(ordered[math.ceil(0.99 * len(ordered)) - 1] * 1e3, 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
        "call_p50_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in per_call.items()},
    }


def run_client(srv, path: Path, version: str, bucket_mb: float, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "bench.weight_push", srv.url, str(path), "--version", version]
    cmd += ["--bucket-mb", str(bucket_mb), *extra]
    # stderr is not captured: a failing client's traceback lands beside ours.
    done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"weight_push exited with {done.returncode} (its stderr is above)")
    return json.loads(done.stdout)


def tensor_part(
    srv, ckpts: list[Path], nbytes: int, repeats: int, bucket_mb: float, memcpy: Memcpy
) -> dict:
    pushes, growth = [], []
    for i in range(repeats):
        memcpy.measure()
        with PeakRss(srv.proc.pid) as rss:
            pushes.append(run_client(srv, ckpts[(i + 1) % 2], f"tensor-{i}", bucket_mb))
        growth.append(rss.growth)
    memcpy.measure()
    path = ckpts[(repeats + 1) % 2]
    sync = run_client(srv, path, "sync-run", bucket_mb, "--sync-run", "--transport", "tensor")
    best = memcpy.reference()
    calls_wall = best_median([p["calls_wall_s"] for p in pushes])
    calls_server = best_median([p["calls_server_s"] for p in pushes])
    return {
        "checkpoint_bytes": nbytes,
        "bucket_mb": bucket_mb,
        "repeats": repeats,
        "calls_wall_s": calls_wall,
        "calls_server_s": calls_server,
        "stage_s": best_median([p["stage_s"] for p in pushes]),
        "memcpy_s": memcpy.report(),
        "memcpy_reference_s": best,
        "ratio_calls_wall_vs_memcpy": ratio(calls_wall, best),
        "ratio_calls_server_vs_memcpy": ratio(calls_server, best),
        "server_rss_anon_growth_bytes_max": max(growth),
        "pushes": pushes,
        "sync_run": sync,
        "read_back_mismatches": [
            m for p in [*pushes, *sync["runs"]] for m in p["read_back_mismatches"]
        ],
    }


def window_of(runs: list[dict]) -> dict:
    return best_median([r["pause_to_continue_s"] for r in runs])


def sync_part(srv, ckpts: list[Path], nbytes: int, repeats: int, bucket_mb: float) -> dict:
    memcpy = Memcpy()
    fresh = []
    for i in range(repeats):  # `grctl push --checkpoint`: a new process each time
        memcpy.measure()
        path = ckpts[(i + 1) % 2]
        fresh += run_client(srv, path, f"auto-{i}", bucket_mb, "--sync-run")["runs"]
    memcpy.measure()
    n = str(repeats + 1)
    alt = ("--alt", str(ckpts[0]))
    shm = run_client(srv, ckpts[1], "shm", bucket_mb, "--sync-run", "--transport", "tensor",
                     "--repeats", n, *alt)  # fmt: skip
    memcpy.measure()
    arena = run_client(srv, ckpts[1], "arena", bucket_mb, "--arena", "--repeats", n, *alt)
    memcpy.measure()
    ref = memcpy.reference()
    figures = {
        "grctl_push_fresh": window_of(fresh),
        "shm_first": window_of(shm["runs"][:1]),
        "shm_steady": window_of(shm["runs"][1:]),
        "arena_first": window_of(arena["runs"][:1]),
        "arena_steady": window_of(arena["runs"][1:]),
    }
    out = {
        "checkpoint_bytes": nbytes,
        "repeats": repeats,
        "memcpy_s": memcpy.report(),
        "memcpy_reference_s": ref,
        **{f"{k}_s": v for k, v in figures.items()},
        **{f"{k}_ratio": ratio(v, ref) for k, v in figures.items()},
        "fresh_runs": fresh,
        "shm": shm,
        "arena": arena,
    }
    out["read_back_mismatches"] = [
        m for r in [*fresh, *shm["runs"], *arena["runs"]] for m in r["read_back_mismatches"]
    ]
    return out


# OpenMP's own default (GNU OpenMP spins 300,000 times before it sleeps when OMP_WAIT_POLICY is
# unset); setting it keeps grctl's passive default away (grctl/threads.py)
OPENMP_SPIN = {"GOMP_SPINCOUNT": "300000"}
SMALL_CONFIG = ModelConfig(
    num_layers=2,
    hidden_size=256,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=6144,
    tie_word_embeddings=False,
    torch_dtype="float32",
)


def small_part(repeats: int, tmp: Path) -> dict:
    """A trainer's small model synced from this process, as a state dict and as an Arena, to a
    server started with no variable set (grctl's default: OMP_WAIT_POLICY=passive,
    grctl/threads.py) and to one with OpenMP's own default restored (GOMP_SPINCOUNT=300000:
    idle threads spin before they sleep, what a server got before grctl set the policy)."""
    path = tmp / "small"
    nbytes = write_random_checkpoint(path, SMALL_CONFIG, num_shards=1, seed=3)
    with Checkpoint(path) as ckpt:
        state = dict(ckpt.iter_tensors())
    out: dict = {"model_bytes": nbytes, "num_tensors": len(state)}
    policies = {"server_default": None, "server_openmp_spin": OPENMP_SPIN}
    for policy, env in policies.items():
        out[policy] = small_syncs(path, state, repeats, env)
    for policy in policies:
        for name in ("state_dict", "arena"):
            out[f"{policy}.{name}_fixed_ms"] = out[policy][f"{name}_fixed_ms"]
    out["arena_fixed_ms"] = out["server_default"]["arena_fixed_ms"]
    return out


def small_syncs(path: Path, state: dict, repeats: int, env) -> dict:
    from grctl.client import WeightSync
    from grctl.rl.arena import Arena

    dst = [torch.empty_like(t) for t in state.values()]
    out: dict = {}
    flags = ("--allow-weight-update", "--model-path", str(path), "--device", "cpu")
    with running_server(*flags, env=env) as srv:
        out["window"] = {k: v for k, v in window_part(srv, 50).items() if k.endswith("ms")}
        arena = Arena(state)
        for name, source in (("state_dict", state), ("arena", arena)):
            totals, copies, stages = [], [], []
            with WeightSync(srv.url) as sync:
                for i in range(repeats):
                    for t in (arena.tensors() if name == "arena" else state).values():
                        t.mul_(-1.0)  # every weight changes each step
                    t0 = time.perf_counter()
                    result = sync.run(source, weight_version=f"{name}-{i}")
                    totals.append(time.perf_counter() - t0)
                    stages.append(result.timings)
                    copies.append(memcpy_seconds(dst, repeats=1))
            best = stages[totals.index(min(totals))]
            out[f"{name}_sync_ms"] = {k: round(v * 1e3, 2) for k, v in best_median(totals).items()}
            out[f"{name}_best_stages_ms"] = {k: round(v * 1e3, 2) for k, v in best.items()}
            out[f"{name}_memcpy_ms"] = round(min(copies) * 1e3, 3)
            sync_ms, copy_ms = out[f"{name}_sync_ms"], out[f"{name}_memcpy_ms"]
            # the sync beyond its bytes at copy speed
            out[f"{name}_fixed_ms"] = {k: round(v - copy_ms, 2) for k, v in sync_ms.items()}
    return out


def big_part(out: dict, parts, ckpts: list[Path], args) -> None:
    """The parts on the 1.08 GB checkpoint, one server."""
    nbytes = ensure_checkpoint(ckpts[0], seed=0)
    assert ensure_checkpoint(ckpts[1], seed=1) == nbytes
    flags = ("--allow-weight-update", "--model-path", str(ckpts[0]), "--device", "cpu")
    env = OPENMP_SPIN if args.omp_spin else None
    out["server_omp_wait_policy"] = "openmp_spin" if args.omp_spin else "grctl_default"
    with running_server(*flags, start_timeout=300, env=env) as srv:
        out["server_rss_anon_bytes_at_start"] = rss_anon_bytes(srv.proc.pid)
        if "window" in parts:
            out["window"] = window_part(srv, args.cycles)
        if "disk" in parts:
            out["disk"] = disk_part(srv, ckpts, nbytes, args.repeats, Memcpy())
        if "tensor" in parts:
            memcpy = Memcpy()
            out["tensor"] = tensor_part(srv, ckpts, nbytes, args.repeats, args.bucket_mb, memcpy)
        if "sync" in parts:
            out["sync"] = sync_part(srv, ckpts, nbytes, args.repeats, args.bucket_mb)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=(*PARTS, "all"), default="all")
    ap.add_argument("--dir", default="/tmp/grctl-bench-1g", help="checkpoint A (served first)")
    ap.add_argument("--dir-b", default="/tmp/grctl-bench-1g-b", help="checkpoint B")
    ap.add_argument("--repeats", type=int, default=4, help="updates per part, alternating B, A")
    ap.add_argument("--cycles", type=int, default=200, help="empty sync windows")
    ap.add_argument("--bucket-mb", type=float, default=512)
    spin = "start the 1 GB server with OpenMP's own spin-wait (GOMP_SPINCOUNT=300000)"
    ap.add_argument("--omp-spin", action="store_true", help=spin)
    args = ap.parse_args()
    parts = PARTS if args.part == "all" else (args.part,)
    ckpts = [Path(args.dir), Path(args.dir_b)]
    out: dict = {"bench": "weight_sync", "device": "cpu", "threads": torch.get_num_threads()}
    out["loadavg_1m_start"] = round(os.getloadavg()[0], 2)  # other processes on the machine
    if any(p != "small" for p in parts):
        big_part(out, parts, ckpts, args)
    if "small" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            out["small"] = small_part(max(args.repeats, 10), Path(tmp))
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    out["checks"] = checks(out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
