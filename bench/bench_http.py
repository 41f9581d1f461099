"""HTTP serving benchmark: /generate against calling the engine directly, on the built-in model.

    python bench/bench_http.py [--device cpu] [--requests 64] [--max-new-tokens 3]

Prints one JSON object: requests/s and p50/p99 latency at beam 1 and beam 32 with 1, 8 and 32
concurrent clients, for the engine called in-process and for `grctl serve` over loopback HTTP
(a real subprocess; the two take turns level by level, never run together), and the HTTP
layer's overhead at concurrency 1: direct and HTTP calls alternated one by one, the median of
the per-pair differences.

Each client thread holds one keep-alive connection and speaks HTTP/1.1 over a plain socket:
on 2 cores a Python HTTP library in 32 threads costs more CPU than the server it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grctl.config import ServeConfig  # noqa: E402
from grctl.engine.config import EngineConfig  # noqa: E402
from grctl.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from grctl.server.serve import build_engine  # noqa: E402
from tests.support.serverproc import running_server  # noqa: E402

BEAMS = (1, 32)
CONCURRENCY = (1, 8, 32)


class RawHTTP:
    """A minimal keep-alive HTTP/1.1 client for JSON bodies (Content-Length replies only)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buf += chunk

    def request(self, method: str, path: str, body: object = None) -> bytes:
        payload = b"" if body is None else msgspec.json.encode(body)
        head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        self.sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head_bytes, _, self.buf = self.buf.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head_bytes).group(1))
        while len(self.buf) < length:
            self._fill()
        reply, self.buf = self.buf[:length], self.buf[length:]
        status = int(head_bytes.split(b" ", 2)[1])
        if status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {status}: {reply[:300]!r}")
        return reply


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_level(call: Callable[[int], None], num_requests: int, concurrency: int) -> dict:
    """`num_requests` calls shared by `concurrency` threads; each thread calls back to back."""
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(num_requests))

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t0 = time.perf_counter()
            call(i)
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {
        "requests": num_requests,
        "rps": round(num_requests / wall, 2),
        "p50_ms": round(1000 * statistics.median(latencies), 3),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 3),
    }


def prompt(i: int, length: int) -> list[int]:
    return [(31 * i + j) % 1000 + 3 for j in range(length)]


def engine_call(engine, args: argparse.Namespace, beam: int) -> Callable[[int], None]:
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, n=beam, ignore_eos=True)
    return lambda i: engine.generate(GenerateRequest(tuple(prompt(i, args.prompt_len)), sampling))


def http_call(client: Callable[[], RawHTTP], args, beam: int) -> Callable[[int], None]:
    params = {"max_new_tokens": args.max_new_tokens, "n": beam, "ignore_eos": True}

    def call(i: int) -> None:
        body = {"input_ids": prompt(i, args.prompt_len), "sampling_params": params}
        client().request("POST", "/generate", body)

    return call


def levels(calls: dict[str, Callable[[int], Callable[[int], None]]], args) -> list[dict]:
    """Each (beam, concurrency) level on every path back to back, so load drift hits all alike."""
    rows = []
    for beam in BEAMS:
        beam_calls = {path: make(beam) for path, make in calls.items()}
        for call in beam_calls.values():
            run_level(call, args.warmup, 1)
        for conc in CONCURRENCY:
            for path, call in beam_calls.items():
                row = run_level(call, max(args.requests, 2 * conc), conc)
                rows.append({"path": path, "beam": beam, "concurrency": conc, **row})
    return rows


def overhead(engine, client, args) -> dict:
    """Direct and HTTP calls alternated one by one at concurrency 1, so background load hits
    both alike; the overhead is the median of the per-pair differences."""
    out = {}
    for beam in BEAMS:
        direct, http = engine_call(engine, args, beam), http_call(client, args, beam)
        pairs = []
        for i in range(args.overhead_pairs):
            t0 = time.perf_counter()
            direct(i)
            t1 = time.perf_counter()
            http(i)
            pairs.append((t1 - t0, time.perf_counter() - t1))
        out[f"beam{beam}"] = {
            "engine_p50_ms": round(1000 * statistics.median(d for d, _ in pairs), 3),
            "http_p50_ms": round(1000 * statistics.median(h for _, h in pairs), 3),
            "overhead_p50_ms": round(1000 * statistics.median(h - d for d, h in pairs), 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=64, help="requests per level (at least 2x)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=3, help="3: one semantic-ID item")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--overhead-pairs", type=int, default=100)
    args = ap.parse_args()

    engine = build_engine(ServeConfig(engine=EngineConfig(device=args.device)))
    engine.start()
    report: dict = {
        "model": "grctl-builtin-gr",
        "device": args.device,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "prompt_len": args.prompt_len,
    }
    try:
        local = threading.local()
        flags = ("--device", args.device, "--max-waiting-requests", "4096")
        with running_server(*flags) as srv:

            def client() -> RawHTTP:
                if not hasattr(local, "client"):
                    local.client = RawHTTP(srv.port)
                return local.client

            calls = {
                "engine": lambda beam: engine_call(engine, args, beam),
                "http": lambda beam: http_call(client, args, beam),
            }
            rows = levels(calls, args)
            health = lambda _: client().request("GET", "/health")  # noqa: E731
            report["health_roundtrip"] = run_level(health, max(args.requests, 200), 1)
            report["http_overhead"] = overhead(engine, client, args)
    finally:
        engine.stop()
    report["results"] = rows
    report["target_overhead_p50_ms"] = 2.0
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
