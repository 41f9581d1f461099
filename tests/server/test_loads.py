"""GET /loads and /v1/loads in SGLang 0.5.23's /v1/loads shape (the keys its LoadSnapshot gives),
their figures against /status read while a request holds its KV, the sections, the
Prometheus form and the refusals. In process on the built-in model."""

from __future__ import annotations

import time

import pytest

from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(120)

# SGLang 0.5.23's reply and the core keys of one rank (sglang/srt/managers/load_snapshot.py)
TOP = {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
CORE = {
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "num_active_tokens",
    "num_prealloc_ready_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "decode_moments",
}
SECTIONS = {
    # SGLang's four, and grctl's host memory (docs/http-api.md: released weights' host copies)
    "memory": {
        "weight_gb",
        "kv_cache_gb",
        "graph_gb",
        "token_capacity",
        "host_rss_gb",
        "weight_host_backup_gb",
    },
    "disaggregation": {
        "mode",
        "prefill_bootstrap_queue_reqs",
        "prefill_inflight_queue_reqs",
        "decode_prealloc_queue_reqs",
        "decode_transfer_queue_reqs",
        "decode_retracted_queue_reqs",
        "kv_transfer_speed_gb_s",
        "kv_transfer_latency_ms",
    },
    "queues": {"waiting", "grammar", "paused", "retracted", "prealloc_ready"},
}
LONG = {"max_new_tokens": 64, "n": 16, "ignore_eos": True}


def one_load(http, query: str = "") -> dict:
    body = http.get("/loads" + query).json()
    assert set(body) == TOP and len(body["loads"]) == 1, body
    return body["loads"][0]


@pytest.mark.parametrize("path", ["/loads", "/v1/loads", "/loads?model=anything"])
def test_every_section_by_default(http, path):
    body = http.get(path).json()
    assert set(body) == TOP and body["num_accelerators"] == 1
    assert body["accelerator"] is None  # the CPU
    (load,) = body["loads"]
    assert set(load) == CORE | set(SECTIONS)
    for name, keys in SECTIONS.items():
        assert set(load[name]) == keys, name
    assert load["dp_rank"] == 0 and load["disaggregation"]["mode"] == "null"
    assert load["max_running_requests"] == http.get("/server_info").json()["max_running_requests"]


@pytest.mark.parametrize(
    ("include", "sections"),
    [
        ("core", set()),
        ("queues", {"queues"}),
        ("core,memory", {"memory"}),
        ("spec,lora", set()),  # sections grctl has nothing for are left out, as SGLang does
        ("disagg, queues", {"disaggregation", "queues"}),
        ("all", set(SECTIONS)),
        ("", set(SECTIONS)),  # SGLang reads an empty include as none
    ],
)
def test_include_picks_the_sections(http, include, sections):
    assert set(one_load(http, f"?include={include}")) == CORE | sections


def test_figures_follow_the_engine(http):
    """A request holding its KV is counted where /status counts it, paused in place too."""
    rid = http.post("/submit", json={"input_ids": [3] * 40, "sampling_params": LONG}).json()
    try:
        deadline = time.monotonic() + 30
        while one_load(http)["num_running_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        load, status = one_load(http), http.get("/status").json()
        sched, cfg = status["scheduler"], http.get("/model_info").json()["model_config"]
        per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 4  # fp32
        per_token *= cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        held = sched["context_kv_bytes"] + sched["beam_kv_bytes"]
        assert load["num_running_reqs"] == sched["num_running"] == 1
        assert load["num_used_tokens"] == held // per_token > 40  # the prompt and 16 tails
        assert load["memory"]["kv_cache_gb"] == round(held / 2**30, 3)
        assert load["queues"]["paused"] == 1 and load["queues"]["waiting"] == 0
        reqs = status["requests"]
        assert (
            load["total_prefill_uncached_tokens"] == reqs["prompt_tokens"] - reqs["cached_tokens"]
        )
    finally:
        http.post("/continue_generation")
        http.post("/abort_request", json={"abort_all": True})
        http.get(f"/result/{rid['request_id']}")
    idle = one_load(http)
    assert idle["num_running_reqs"] == idle["num_used_tokens"] == idle["queues"]["paused"] == 0


def test_prometheus_form(http):
    resp = http.get("/v1/loads?format=prometheus")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in resp.text.splitlines():
        if line.startswith("# TYPE "):
            assert line.endswith(" gauge")
            continue
        name, value = line.split(" ")
        assert name.endswith('{dp_rank="0"}'), line
        samples[name.split("{")[0]] = float(value)
    want = {f"sglang_{k}" for k in CORE - {"dp_rank", "decode_moments"}}
    want |= {f"sglang_memory_{k}" for k in SECTIONS["memory"]}
    want |= {f"sglang_queues_{k}" for k in SECTIONS["queues"]}
    want |= {f"sglang_disagg_{k}" for k in SECTIONS["disaggregation"] - {"mode"}}
    assert set(samples) == want
    assert samples["sglang_max_running_requests"] == one_load(http)["max_running_requests"]


def test_another_rank_has_no_load(http):
    assert http.get("/loads?dp_rank=1").json()["loads"] == []
    assert len(http.get("/loads?dp_rank=0").json()["loads"]) == 1


@pytest.mark.parametrize(
    ("query", "word"),
    [
        ("?include=core,bogus", "bogus"),
        ("?format=xml", "format"),
        ("?dp_rank=first", "dp_rank"),
    ],
)
def test_bad_queries_are_a_400(http, query, word):
    err = assert_error(http.get("/loads" + query), 400, "validation_error")
    assert word in err["message"]
