"""The stall probe: how long /health takes to answer while an action runs on the same server.

    worst, reply = health_while(srv.client, lambda http: http.post("/generate", json=body))

A poll every 10 ms from its own thread and client; the slowest answer among the polls that
overlapped the action (and the first one after it) is returned beside the action's reply. A
route that does CPU work on the event loop instead of through server/offload.py holds every
poll for as long as the work runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

INTERVAL_S = 0.01


def health_while(client_factory: Callable[[], Any], action: Callable[[Any], Any]):
    """(slowest /health answer in seconds, action's result); action gets a client of its own."""
    started, done, latencies = threading.Event(), threading.Event(), []

    def poll() -> None:
        with client_factory() as client:
            client.get("/health")  # connected before the action starts
            started.set()
            while True:
                last = done.is_set()
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
        done.set()
        thread.join(60)
    return max(latencies, default=0.0), out


def calm_health(client_factory, action, tries: int = 3, limit_s: float = 0.1):
    """The best of `tries` probes (a loaded machine may delay one poll): (worst, results)."""
    worst, results = [], []
    for _ in range(tries):
        w, out = health_while(client_factory, action)
        worst.append(w)
        results.append(out)
        if w < limit_s:
            break
    return min(worst), results
