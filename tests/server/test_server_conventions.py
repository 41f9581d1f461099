"""Conventions users of SGLang and vLLM expect: /metrics open (unless --metrics-auth) with
counters typed as counters, --served-model-name, --context-length, and the OpenAPI UI and
document served without a network; in process (Litestar's test client)."""

from __future__ import annotations

import re

import pytest

from tests.support.appserver import app_server
from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(120)
KEY = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def keyed(start_app):
    flags = ("--api-key", "sekrit", "--served-model-name", "gr-rec", "--context-length", "512")
    return start_app(*flags)


def types_of(text: str) -> dict[str, str]:
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name not in types, f"{name} typed twice"
            types[name] = kind
    return types


def test_metrics_are_open_and_typed(keyed):
    with keyed.client() as http:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}
        assert http.post("/generate", json=body, headers=KEY).status_code == 200
        assert_error(http.get("/status"), 401, "unauthorized")
        resp = http.get("/metrics")  # no key: open, as in SGLang and vLLM
    assert resp.status_code == 200
    types = types_of(resp.text)
    for name, kind in types.items():  # Prometheus naming: counters, and only they, end in _total
        assert (kind == "counter") == name.endswith("_total"), (name, kind)
    for counter in (
        "gr_scheduler_steps_total",
        "gr_scheduler_decode_rows_total",
        "gr_prefill_cache_hits_total",
        "gr_requests_generated_tokens_total",
        "gr_weights_weight_update_count_total",
        "gr_http_requests_total",
    ):
        assert types[counter] == "counter", counter
    for gauge in ("gr_scheduler_running", "gr_requests_latency_s_max", "gr_ready"):
        assert types[gauge] == "gauge", gauge
    assert types["gr_http_request_duration_seconds"] == "histogram"
    steps = re.search(r"^gr_scheduler_steps_total (\S+)$", resp.text, re.M)
    assert steps and float(steps.group(1)) >= 2  # a prefill and at least one decode step


def test_metrics_auth_guards_metrics():
    with app_server("--api-key", "sekrit", "--metrics-auth") as srv, srv.client() as http:
        assert_error(http.get("/metrics"), 401, "unauthorized")
        assert http.get("/metrics", headers=KEY).status_code == 200


def test_served_model_name_and_context_length(keyed):
    with keyed.client(headers=KEY) as http:
        info = http.get("/server_info").json()
        assert info["served_model_name"] == "gr-rec" and info["context_length"] == 512
        assert info["model_path"] != "gr-rec"
        assert http.get("/get_model_info").json()["served_model_name"] == "gr-rec"
        too_long = {"input_ids": [1] * 510, "sampling_params": {"max_new_tokens": 8}}
        assert_error(http.post("/generate", json=too_long), 400, "validation_error")


def test_openapi_ui_renders_from_local_assets(keyed):
    with keyed.client() as http:  # no key: the document and UI describe routes, not data
        page = http.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
        assert len(urls) >= 3
        for url in urls:
            assert url.startswith("/docs/assets/"), url  # nothing from a CDN
            assert http.get(url).status_code == 200, url
        schema = http.get("/openapi.json").json()
        assert schema == http.get("/schema/openapi.json").json()
        assert {"/generate", "/release_memory_occupation", "/metrics"} <= set(schema["paths"])
        assert "/docs" not in schema["paths"]
