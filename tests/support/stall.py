"""The stall probe: how long /health takes to answer while an action runs on the same server.

    worst, reply = health_while(srv.client, lambda http: http.post("/generate", json=body))

A poll every 10 ms from its own thread and client; the slowest answer among the polls that
overlapped the action and the TAIL_S after its reply (a route's worker may go on building
results, or exporting a profile, once the reply is sent) is returned beside the action's reply.
A route that does CPU work on the event loop instead of through server/offload.py, or that
leaves GIL-holding work behind its reply, holds every poll for as long as the work runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

INTERVAL_S = 0.01
TAIL_S = 1.0


def health_while(client_factory: Callable[[], Any], action: Callable[[Any], Any]):
    """(slowest /health answer in seconds, action's result); action gets a client of its own."""
    started, done, latencies = threading.Event(), threading.Event(), []
    ended = [0.0]

    def poll() -> None:
        with client_factory() as client:
            client.get("/health")  # connected before the action starts
            started.set()
            while True:
                last = done.is_set() and time.perf_counter() - ended[0] >= TAIL_S
                t0 = time.perf_counter()
                client.get("/health")
                latencies.append(time.perf_counter() - t0)
                if last:
                    return
                time.sleep(INTERVAL_S)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    started.wait(30)
    try:
        with client_factory() as client:
            out = action(client)
    finally:
        ended[0] = time.perf_counter()
        done.set()
        thread.join(60 + TAIL_S)
    return max(latencies, default=0.0), out


def steady_health(client_factory, action, limit_s: float = 0.1):
    """One probe; one over `limit_s` is tried twice more and the median of the three kept (a
    loaded machine may delay one poll; a route that stalls stalls each time): (worst, results).
    Never the best of the tries."""
    worst, out = health_while(client_factory, action)
    if worst < limit_s:
        return worst, [out]
    tries, results = [worst], [out]
    for _ in range(2):
        w, out = health_while(client_factory, action)
        tries.append(w)
        results.append(out)
    return sorted(tries)[1], results
