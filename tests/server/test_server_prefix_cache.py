"""The prefix cache over HTTP: SGLang's meta_info.cached_tokens, its /status section and its
/metrics counters; in process (Litestar's test client), the cache on by default."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.timeout(120)


def series(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def test_requests_sharing_a_prefix_report_cached_tokens(start_app):
    srv = start_app("--max-new-tokens", "4")
    shared = list(range(3, 40))
    sp = {"max_new_tokens": 2, "n": 2}
    with srv.client() as http:
        replies = [
            http.post("/generate", json={"input_ids": shared + tail, "sampling_params": sp})
            for tail in ([7, 8], [9], [7, 8])
        ]
        metrics = http.get("/metrics").text
        cache = http.get("/status").json()["prefill_cache"]
    assert [r.status_code for r in replies] == [200] * 3
    cached = [r.json()["meta_info"]["cached_tokens"] for r in replies]
    # none, the prefix, an exact repeat: all but its last token, as SGLang (which computes it
    # again) counts; the cache's own counters count the whole prompt it reused
    assert cached == [0, len(shared), len(shared) + 1]
    assert replies[0].json()["output_ids"] == replies[2].json()["output_ids"]
    reused = sum(cached) + 1
    assert (cache["hits"], cache["misses"], cache["hit_tokens"]) == (2, 1, reused)
    assert series(metrics, "gr_prefill_cache_hits_total") == 2
    assert series(metrics, "gr_prefill_cache_misses_total") == 1
    assert series(metrics, "gr_prefill_cache_hit_tokens_total") == reused
    assert series(metrics, "gr_prefill_cache_evictions_total") == 0
    assert series(metrics, "gr_prefill_cache_bytes") == cache["bytes"] > 0
    assert series(metrics, "gr_requests_cached_tokens_total") == sum(cached)


def test_disable_radix_cache_reports_none(start_app):
    srv = start_app("--disable-radix-cache")
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1}}
    with srv.client() as http:
        cached = [http.post("/generate", json=body).json()["meta_info"]["cached_tokens"]]
        cached += [http.post("/generate", json=body).json()["meta_info"]["cached_tokens"]]
        assert http.get("/server_info").json()["enable_prefill_cache"] is False
    assert cached == [0, 0]
