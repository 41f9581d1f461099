"""Soak: generation never stops while a trainer swaps weights in place, cycle after cycle.

    python bench/soak.py [--duration-s 600] [--threads 4] [--max-new-tokens 6] [--chunks 3]

One real `grctl serve` (CPU, --enable-prefill-cache) starts on checkpoint "ckA". Three tiny
random Qwen3 checkpoints (ckA, ckB, ckC) are written with transformers, and transformers computes
each one's greedy outputs on a fixed set of prompts; the checkpoints must give different outputs
on every prompt, so an answer's outputs name the weights they came from. Each checkpoint is
pushed with its own name as weight_version.

- `--threads` client threads call /generate back to back (greedy, ignore_eos).
- One trainer loop runs sync cycles: pause_generation(mode) -> flush_cache until 200 (in_place:
  one try; frozen requests keep their KV) -> update_weights_from_disk, or the checkpoint in
  `--chunks` flattened_bucket pushes over shared memory -> continue_generation. Transports
  alternate, pause modes go abort, retract, in_place (every combination once per six cycles, no
  two in_place cycles in a row), and the next checkpoint is always another one.

Every answer is checked as it arrives:
- 5xx other than 503 `paused` or `weights_mixed` (retryable, inside a sync cycle: a tensor push
  leaves two labels between its chunks), any 4xx, or a transport error: a violation;
- 200 with one version: output_ids equal transformers' outputs of that checkpoint;
- 200 with several versions A, B, ... (meta_info.weight_versions spans): each change only during
  an in_place or retract cycle A -> B, and output_ids equal what transformers gives token by
  token when each span's tokens are chosen by its checkpoint and, at each change, the KV before
  is kept (in_place: A's KV, continued by B) or recomputed by B (retract);
- 200 with finish_reason abort: only during an abort-mode pause; outputs a prefix of its version's.
Resources of the server process (RssAnon, open fds, /dev/shm segments it maps) and this process's
own shared-memory segments are sampled at cycle boundaries under load: the first sample after the
warm-up cycles is the baseline, the last one is the end. At the end the served checksums must
equal the current checkpoint's. Prints one JSON object on stdout; exit status 1 on a violation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grctl.weights.wire.encode import encode_bucket  # noqa: E402
from tests.support.checkpoints import load_hf, write_checkpoint  # noqa: E402
from tests.support.reference import hf_generate  # noqa: E402
from tests.support.serverproc import running_server  # noqa: E402
from tests.support.weight_helpers import checkpoint_sha256, served_sha256  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [17, 9], [40] * 11, [7, 100, 3, 64, 21, 8, 90]]
MODES = ("abort", "retract", "in_place")
TRANSPORTS = ("disk", "tensor")
CHECKPOINT_SEEDS = {"ckA": 101, "ckB": 102, "ckC": 103}
MAX_VIOLATIONS_KEPT = 50


@dataclass
class SoakConfig:
    duration_s: float = 60.0
    num_threads: int = 4
    max_new_tokens: int = 6
    num_chunks: int = 3
    warmup_cycles: int = 12
    sample_every_s: float = 10.0
    max_gap_s: float = 0.1  # the trainer waits up to this long between cycles
    seed: int = 0
    max_rss_growth_pct: float = 5.0
    max_fd_growth: int = 2
    max_shm_growth: int = 2


# ---- references ----------------------------------------------------------------------------


class Reference:
    """The checkpoints, what transformers says each one generates, and their tensors to push."""

    def __init__(self, root: Path, max_new_tokens: int, prompts=PROMPTS):
        self.max_new_tokens = max_new_tokens
        self.paths = {n: write_checkpoint(root / n, seed=s) for n, s in CHECKPOINT_SEEDS.items()}
        self.models = {name: load_hf(path) for name, path in self.paths.items()}
        # name -> prompt -> transformers' greedy output_ids
        self.expected = {
            name: {tuple(p): hf_generate(model, p, max_new_tokens) for p in prompts}
            for name, model in self.models.items()
        }
        for p in prompts:
            outs = [tuple(self.expected[name][tuple(p)]) for name in self.paths]
            if len(set(outs)) != len(outs):
                raise RuntimeError(f"checkpoints give the same greedy outputs on {p}: reseed")
        self.tensors = {
            name: [(n, t.detach().clone()) for n, t in model.state_dict().items()]
            for name, model in self.models.items()
        }
        self._lock = threading.Lock()

    def follows(self, prompt: list[int], out: list[int], spans: list, modes: tuple) -> bool:
        """Whether greedy decoding gives `out` (or its first tokens, for an abort) when each
        token is chosen by the checkpoint its span names and, at each span's first token, the
        KV of what came before is kept (in_place: the old weights' KV, continued by the new) or
        recomputed by the new checkpoint (retract): transformers, token by token."""
        at = [v for v, start, end in spans for _ in range(start, end)]
        edges = {start: mode for (_, start, _), mode in zip(spans[1:], modes, strict=True)}
        with self._lock, torch.no_grad():  # one replay at a time on the shared models
            step = self.models[at[0]](torch.tensor([prompt]), use_cache=True)
            if int(step.logits[0, -1].argmax()) != out[0]:
                return False
            cache = step.cache
            for t in range(1, len(out)):
                model = self.models[at[t]]
                if edges.get(t) == "retract":  # the prompt and tokens before: the new KV
                    cache = model(torch.tensor([prompt + out[: t - 1]]), use_cache=True).cache
                step = model(torch.tensor([[out[t - 1]]]), cache=cache, use_cache=True)
                if int(step.logits[0, -1].argmax()) != out[t]:
                    return False
                cache = step.cache
        return True


# ---- what the server may answer ------------------------------------------------------------


@dataclass
class Window:
    """One sync cycle, from just before pause_generation to just after continue_generation."""

    mode: str
    old: str
    new: str
    start: float
    end: float | None = None


@dataclass
class Tally:
    ok: int = 0
    ok_across_retract: int = 0
    recomputed_across_retract: int = 0
    aborted: int = 0
    mixed_in_place: int = 0
    paused_503: int = 0
    violations: list[str] = field(default_factory=list)
    num_violations: int = 0


class Checker:
    def __init__(self, ref: Reference):
        self.ref = ref
        self.windows: list[Window] = []
        self.tally = Tally()
        self._lock = threading.Lock()

    def begin(self, mode: str, old: str, new: str) -> Window:
        w = Window(mode, old, new, time.monotonic())
        with self._lock:
            self.windows.append(w)
        return w

    def end(self, w: Window) -> None:
        with self._lock:
            w.end = time.monotonic()

    def _overlapping(self, t0: float, t1: float) -> list[Window]:
        out = []
        with self._lock:
            for w in reversed(self.windows):  # cycles run one after another, in order
                if w.end is not None and w.end < t0:
                    break
                if w.start <= t1:
                    out.append(w)
        return out

    def violation(self, what: str) -> None:
        with self._lock:
            self.tally.num_violations += 1
            if len(self.tally.violations) < MAX_VIOLATIONS_KEPT:
                self.tally.violations.append(what)

    def count(self, key: str) -> None:
        with self._lock:
            setattr(self.tally, key, getattr(self.tally, key) + 1)

    def check(self, prompt: list[int], resp: httpx.Response, t0: float, t1: float) -> None:
        where = f"prompt {prompt}: {resp.status_code} {resp.text[:300]}"
        if resp.status_code == 503:
            err = resp.json().get("error", {})
            is_sync_503 = err.get("code") in ("paused", "weights_mixed")
            if not is_sync_503 or err.get("retryable") is not True:
                return self.violation(f"503 not paused/weights_mixed/retryable: {where}")
            if not self._overlapping(t0, t1):
                return self.violation(f"503 paused outside any sync cycle: {where}")
            return self.count("paused_503")
        if resp.status_code != 200:
            return self.violation(f"status {resp.status_code}: {where}")
        meta = resp.json()["meta_info"]
        out, version, versions = (
            resp.json()["output_ids"],
            meta["weight_version"],
            [span["version"] for span in meta["weight_versions"] if span["end"] > span["start"]],
        )
        expected = self.ref.expected.get(version, {}).get(tuple(prompt))
        if expected is None:
            return self.violation(f"unknown weight_version {version!r}: {where}")
        cycles = self._overlapping(t0, t1)
        aborted = meta["finish_reason"]["type"] == "abort"
        if aborted and not any(w.mode == "abort" for w in cycles):
            return self.violation(f"aborted outside an abort-mode cycle: {where}")
        if len(versions) >= 2:
            # Across pauses with updates: frozen by an in_place pause A -> B and resumed on B
            # (B's tokens on A's KV), or retracted A -> B (B continues A's tokens, all of their
            # KV recomputed); a request may straddle several such cycles, and a later
            # abort-mode pause may end it.
            spans = [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]]
            spans = [sp for sp in spans if sp[2] > sp[1]]
            if version != versions[-1]:
                return self.violation(f"weight_version is not the last token's: {where}")
            choices = []
            for (a, _, _), (b, _, _) in zip(spans, spans[1:], strict=False):
                modes = {w.mode for w in cycles if (w.old, w.new) == (a, b)}
                choices.append(sorted(modes & {"in_place", "retract"}))
            if not all(choices):
                return self.violation(f"versions {versions} change outside a cycle: {where}")
            for modes in itertools.product(*choices):
                if self.ref.follows(prompt, out, spans, modes):
                    if aborted:
                        return self.count("aborted")
                    kind = "recomputed_across_retract" if "retract" in modes else "mixed_in_place"
                    return self.count(kind)
            return self.violation(f"no greedy run across {versions} gives these outputs: {where}")
        if aborted:
            if versions not in ([], [version]) or out != expected[: len(out)]:
                return self.violation(f"aborted answer is not a prefix of {version}'s: {where}")
            return self.count("aborted")
        if versions != [version] or out != expected:
            return self.violation(f"outputs are not {version}'s ({expected}): {where}")
        if any(w.mode == "retract" and w.new == version and w.end for w in cycles):
            return self.count("ok_across_retract")  # retracted before its first token
        return self.count("ok")


# ---- resources -----------------------------------------------------------------------------


def read_resources(pid: int) -> dict:
    status = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            status[key] = value.split()
    shm_maps = set()
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                shm_maps.add(parts[5].strip())
    try:
        dev_shm = os.listdir("/dev/shm")
    except OSError:
        dev_shm = []
    mine = f"torch_{os.getpid()}_"
    return {
        "t": round(time.monotonic(), 3),
        "rss_anon_kb": int(status["RssAnon"][0]),
        "threads": int(status["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "server_shm_maps": len(shm_maps),
        "client_shm_segments": sum(name.startswith(mine) for name in dev_shm),
        "dev_shm_entries": len(dev_shm),
    }


# ---- the run -------------------------------------------------------------------------------


def client_loop(url: str, idx: int, checker: Checker, max_new: int, stop: threading.Event):
    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=120) as c:
        i = idx
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            t0 = time.monotonic()
            try:
                resp = c.post("/generate", json={"input_ids": prompt, "sampling_params": sp})
            except httpx.HTTPError as exc:
                checker.violation(f"client {idx}: {type(exc).__name__}: {exc}")
                time.sleep(0.1)
                continue
            try:
                checker.check(prompt, resp, t0, time.monotonic())
            except (ValueError, KeyError, TypeError) as exc:  # not the protocol's shape
                checker.violation(f"client {idx}: unreadable answer ({exc}): {resp.text[:300]}")
            if resp.status_code == 503:  # retryable: back off a little, as a real client does
                time.sleep(random.uniform(0.005, 0.02))


def chunks(named: list, num_chunks: int) -> list[list]:
    size = -(-len(named) // num_chunks)
    return [named[i : i + size] for i in range(0, len(named), size)]


def sync_cycle(c: httpx.Client, ref: Reference, mode: str, transport: str, target: str, cfg):
    """One trainer cycle; raises AssertionError with the reply when a step is refused."""
    r = c.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200, f"pause {mode}: {r.status_code} {r.text}"
    if mode == "in_place":  # frozen requests hold KV: a flush refuses while any is in flight
        r = c.get("/flush_cache")
        assert r.status_code in (200, 400), f"flush: {r.status_code} {r.text}"
    else:
        for _ in range(400):
            r = c.get("/flush_cache")
            if r.status_code == 200:
                break
            assert r.status_code == 400, f"flush: {r.status_code} {r.text}"
            time.sleep(0.005)
        assert r.status_code == 200, "flush_cache never answered 200 after a pause"
    if transport == "disk":
        body = {"model_path": str(ref.paths[target]), "weight_version": target}
        r = c.post("/update_weights_from_disk", json=body)
        assert r.status_code == 200, f"disk update: {r.status_code} {r.text}"
    else:
        parts = chunks(ref.tensors[target], cfg.num_chunks)
        for i, part in enumerate(parts):
            keep: list = []
            body = {
                "serialized_named_tensors": [encode_bucket(part, keep_alive=keep)],
                "load_format": "flattened_bucket",
                "weight_version": target,
                "flush_cache": i == len(parts) - 1,
            }
            r = c.post("/update_weights_from_tensor", json=body)
            del keep, body  # the reply came: the server holds nothing of ours
            assert r.status_code == 200, f"tensor chunk {i}: {r.status_code} {r.text}"
    r = c.post("/continue_generation")
    assert r.status_code == 200, f"continue: {r.status_code} {r.text}"


def summarize(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    return {
        "n": len(values),
        "p50": round(statistics.median(values), 2),
        "p99": round(values[min(len(values) - 1, int(0.99 * len(values)))], 2),
        "max": round(values[-1], 2),
    }


def resource_growth(base: dict, final: dict, cfg: SoakConfig) -> tuple[dict, list[str]]:
    growth = {
        "rss_anon_pct": round(100.0 * (final["rss_anon_kb"] / base["rss_anon_kb"] - 1.0), 3),
        "fds": final["fds"] - base["fds"],
        "server_shm_maps": final["server_shm_maps"] - base["server_shm_maps"],
        "client_shm_segments": final["client_shm_segments"] - base["client_shm_segments"],
        "dev_shm_entries": final["dev_shm_entries"] - base["dev_shm_entries"],  # others' too
    }
    bad = []
    if growth["rss_anon_pct"] >= cfg.max_rss_growth_pct:
        bad.append(f"server RssAnon grew {growth['rss_anon_pct']}% after warm-up")
    for key, limit in (
        ("fds", cfg.max_fd_growth),
        ("server_shm_maps", cfg.max_shm_growth),
        ("client_shm_segments", cfg.max_shm_growth),
    ):
        if growth[key] > limit:
            bad.append(f"{key} grew by {growth[key]} after warm-up (limit {limit})")
    return growth, bad


def run_soak(cfg: SoakConfig, workdir: Path, ref: Reference | None = None) -> dict:
    """Run the soak and return the report; `report["violations"]` empty means it held."""
    ref = ref or Reference(workdir, cfg.max_new_tokens)
    checker = Checker(ref)
    rng = random.Random(cfg.seed)
    current = "ckA"
    args = ("--allow-weight-update", "--enable-prefill-cache", "--weight-version", current)
    report: dict = {"config": asdict(cfg)}
    with running_server(*args, "--model-path", str(ref.paths[current])) as srv:
        pid = srv.proc.pid
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=client_loop,
                args=(srv.url, i, checker, cfg.max_new_tokens, stop),
                daemon=True,
            )
            for i in range(cfg.num_threads)
        ]
        for t in threads:
            t.start()
        cycle_ms: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
        by_kind: dict[str, int] = {}
        samples: list[dict] = []
        base = None
        t_start = time.monotonic()
        last_sample = 0.0
        i = 0
        trainer_error = None
        with srv.client(timeout=120) as c:
            while time.monotonic() - t_start < cfg.duration_s or i < cfg.warmup_cycles + 6:
                mode, transport = MODES[i % len(MODES)], TRANSPORTS[i % len(TRANSPORTS)]
                target = rng.choice([n for n in ref.paths if n != current])
                window = checker.begin(mode, current, target)
                t0 = time.perf_counter()
                try:
                    sync_cycle(c, ref, mode, transport, target, cfg)
                except (AssertionError, httpx.HTTPError) as exc:
                    trainer_error = f"cycle {i} ({transport}/{mode} -> {target}): {exc}"
                    checker.end(window)
                    break
                checker.end(window)
                cycle_ms[transport].append((time.perf_counter() - t0) * 1000.0)
                kind = f"{transport}/{mode}"
                by_kind[kind] = by_kind.get(kind, 0) + 1
                current = target
                i += 1
                now = time.monotonic()
                if i == cfg.warmup_cycles or (
                    i > cfg.warmup_cycles and now - last_sample >= cfg.sample_every_s
                ):
                    samples.append({"cycle": i, **read_resources(pid)})
                    last_sample = now
                    base = base or samples[-1]
                time.sleep(rng.uniform(0.0, cfg.max_gap_s))  # requests run between cycles
            samples.append({"cycle": i, **read_resources(pid)})
            stop.set()
            for t in threads:
                t.join(150)
            elapsed = time.monotonic() - t_start
            alive = srv.proc.poll() is None and c.get("/health").status_code == 200
            checksum_ok = served_sha256(c) == checkpoint_sha256(ref.paths[current])
            version = c.get("/get_weight_version").json()
        log = srv.log_text()
    violations = list(checker.tally.violations)
    if trainer_error:
        violations.append(f"trainer: {trainer_error}")
    if not alive:
        violations.append("the server is not alive and healthy at the end")
    if not checksum_ok:
        violations.append(f"served checksums are not {current}'s at the end")
    if version["weight_version"] != current:
        violations.append(f"weight_version {version['weight_version']!r} at the end, not {current}")
    if "Traceback" in log:
        violations.append("the server logged a traceback: " + log[log.index("Traceback") :][:2000])
    growth, bad = resource_growth(base or samples[0], samples[-1], cfg)
    half = [s for s in samples if s["cycle"] >= (samples[0]["cycle"] + i) / 2] or samples
    if half[-1]["cycle"] > half[0]["cycle"]:  # a leak keeps its slope; warm-up flattens out
        growth["rss_anon_kb_per_1000_cycles_second_half"] = round(
            1000
            * (half[-1]["rss_anon_kb"] - half[0]["rss_anon_kb"])
            / (half[-1]["cycle"] - half[0]["cycle"]),
            1,
        )
    violations += bad
    tally = asdict(checker.tally)
    tally.pop("violations")
    report.update(
        elapsed_s=round(elapsed, 1),
        num_cycles=i,
        cycles_by_kind=by_kind,
        requests=tally,
        cycle_ms={t: summarize(v) for t, v in cycle_ms.items()},
        resources={"baseline": base, "final": samples[-1], "growth": growth},
        peak_rss_anon_kb=max(s["rss_anon_kb"] for s in samples),
        samples=samples,
        final_weight_version=version["weight_version"],
        weight_update_count=version["weight_update_count"],
        final_checksum_ok=checksum_ok,
        violations=violations,
    )
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = SoakConfig()
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=d.num_threads)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--chunks", type=int, default=d.num_chunks)
    ap.add_argument("--warmup-cycles", type=int, default=d.warmup_cycles)
    ap.add_argument("--sample-every-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--samples", action="store_true", help="keep every resource sample")
    a = ap.parse_args()
    cfg = SoakConfig(
        duration_s=a.duration_s,
        num_threads=a.threads,
        max_new_tokens=a.max_new_tokens,
        num_chunks=a.chunks,
        warmup_cycles=a.warmup_cycles,
        sample_every_s=a.sample_every_s,
        seed=a.seed,
    )
    with tempfile.TemporaryDirectory(prefix="grctl-soak-") as tmp:
        report = run_soak(cfg, Path(tmp))
    if not a.samples:
        report.pop("samples")
    print(json.dumps(report, indent=2))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
