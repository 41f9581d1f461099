"""/metrics in the conventions fleets read, on a real server: prometheus_client's exposition
(parsed back here by its own parser), HELP on every family, SGLang's names and labels for what
SGLang exports, the weight version as an info metric, unmatched routes under one bounded label;
Retry-After on retryable refusals; a router's non-HTTP probe counted, not logged as a warning."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(180)
NAME = "gr-metrics"
SCHED = {"model_name": NAME, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


@pytest.fixture(scope="module")
def srv(start_server, tiny_checkpoint):
    flags = ["--model-path", str(tiny_checkpoint), "--served-model-name", NAME]
    return start_server(*flags, "--allow-weight-update", "--max-waiting-requests", "1")


def families(http) -> dict:
    resp = http.get("/metrics")
    assert resp.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def sample(fams: dict, name: str, **labels: str) -> float:
    family = fams[name]
    for s in family.samples:
        if all(s.labels.get(k) == v for k, v in labels.items()) and not s.name.endswith("_created"):
            return s.value
    raise KeyError((name, labels))


def test_every_family_has_help_and_sglangs_names(srv):
    with srv.client() as http:
        before = families(http)
        body = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 3}}
        assert http.post("/generate", json=body).status_code == 200
        fams = families(http)
    assert all(f.documentation.strip() for f in fams.values()), [
        n for n, f in fams.items() if not f.documentation.strip()
    ]
    # the model-server protocol's three, with SGLang's labels
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"):
        assert fams[name].type == "gauge"
        assert sample(fams, name, **SCHED) == 0.0
    prompt = "sglang:prompt_tokens"  # counters: the parser drops _total from the family name
    grown = sample(fams, prompt, model_name=NAME, is_streaming="false") - sample(
        before, prompt, model_name=NAME, is_streaming="false"
    )
    assert grown == 5
    gen = sample(fams, "sglang:generation_tokens", model_name=NAME) - sample(
        before, "sglang:generation_tokens", model_name=NAME
    )
    assert gen == 3
    assert fams["sglang:e2e_request_latency_seconds"].type == "histogram"
    assert sample(fams, "sglang:num_requests", model_name=NAME) >= 1
    assert fams["gr_scheduler_steps"].type == "counter"  # grctl's own, as before
    assert not any(n.startswith("gr_weights_label_counts") for n in fams)  # free text: no name


def test_running_requests_show_while_they_run(srv):
    with srv.client() as http:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 60, "n": 16}}
        t = threading.Thread(target=lambda: http.post("/generate", json=body))
        t.start()
        seen = 0.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not seen and t.is_alive():
            seen = sample(families(http), "sglang:num_running_reqs", **SCHED)
        t.join(60)
        assert seen == 1.0


def test_the_weight_version_is_an_info_metric(srv):
    with srv.client() as http:
        r = http.post("/update_weight_version", json={"new_version": "v-7"})
        assert r.status_code == 200, r.text
        fams = families(http)
    # the text format has no info type: a gauge of 1 named *_info, the version its label
    assert fams["gr_weight_version_info"].type == "gauge"
    assert sample(fams, "gr_weight_version_info", weight_version="v-7") == 1.0
    labelled = [s for s in fams["gr_weight_version_info"].samples]
    assert len(labelled) == 1  # one series: the old version's is gone


def test_unmatched_routes_count_under_one_label(srv):
    with srv.client() as http:
        before = families(http)
        for path in ("/nope", "/wp-login.php", "/admin/../etc", "/nope?x=1"):
            assert http.get(path).status_code == 404
        fams = families(http)
    key = {"route": "unmatched", "method": "GET", "status": "404"}
    try:
        was = sample(before, "gr_http_requests", **key)
    except KeyError:
        was = 0.0
    assert sample(fams, "gr_http_requests", **key) - was == 4
    routes = {s.labels.get("route") for s in fams["gr_http_requests"].samples}
    assert not any("nope" in r or "wp-login" in r for r in routes)


def test_retryable_refusals_carry_retry_after(srv):
    with srv.client() as http:
        assert http.post("/pause_generation", json={}).status_code == 200
        try:
            r = http.post("/generate", json={"input_ids": [1, 2]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "paused"
            assert r.headers["Retry-After"] == "1"
        finally:
            assert http.post("/continue_generation", json={}).status_code == 200
        assert "Retry-After" not in http.post("/generate", json={"input_ids": [999999]}).headers


def test_a_non_http_probe_is_counted_not_warned(srv):
    with srv.client() as http:
        before = sample(families(http), "gr_http_invalid_requests")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(b"\x16\x03\x01\x02\x00garbage-not-http\r\n\r\n")  # a TLS hello, say
            try:
                sock.recv(1024)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if sample(families(http), "gr_http_invalid_requests") > before:
                break
            time.sleep(0.1)
        assert sample(families(http), "gr_http_invalid_requests") == before + 1
    assert "Invalid HTTP request" not in srv.log_text()
    assert httpx.get(srv.url + "/health").status_code == 200
