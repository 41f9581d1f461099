"""Status, metrics, discovery, /flush_cache, pause behaviour and Litestar's own errors, in process
on the built-in model (Litestar's test client)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.appserver import app_server
from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(120)

LONG = {"max_new_tokens": 64, "n": 32, "ignore_eos": True}


def wait_until_running(http, timeout: float = 30.0) -> None:
    """Until the engine computes a request (a LONG one runs for a second or more on CPU)."""
    deadline = time.monotonic() + timeout
    while http.get("/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_status(http):
    body = http.get("/status").json()
    for key in ("scheduler", "prefill_cache", "engine", "weights"):
        assert isinstance(body[key], dict), key
    assert set(body["weights"]) >= {
        "weight_version",
        "token_step",
        "weight_update_count",
        "last_weight_update_ms",
    }
    assert body["weights"]["weight_version"] == "default"


def test_metrics_prometheus_text(http):
    http.post("/generate", json={"input_ids": [1, 2]})
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert "# TYPE gr_http_requests_total counter" in text
    assert 'gr_http_requests_total{method="POST",route="/generate",status="200"}' in text
    assert "# TYPE gr_http_request_duration_seconds histogram" in text
    assert 'gr_http_request_duration_seconds_bucket{le="+Inf",route="/generate"}' in text
    assert "# TYPE gr_generate_latency_seconds histogram" in text
    assert 'gr_generate_results_total{finish_reason="length"}' in text
    assert "# TYPE gr_requests_generated_tokens_total counter" in text
    assert "gr_ready 1.0" in text and "gr_scheduler_paused 0.0" in text
    for line in text.splitlines():  # every sample line is `name{labels} number`
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info(http, path):
    body = http.get(path).json()
    assert body["tp_size"] == body["dp_size"] == body["pp_size"] == body["ep_size"] == 1
    assert body["enable_memory_saver"] is False
    assert body["model_path"] and body["weight_version"] == "default"
    assert body["device"] == "cpu" and body["gpu_uuid"] is None  # a UUID names a GPU only


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info(http, path):
    body = http.get(path).json()
    assert body["is_generation"] is True and body["weight_version"] == "default"
    assert body["model_path"]


def test_health_generate_and_loads(http):
    assert http.get("/health_generate").status_code == 200
    (load,) = http.get("/v1/loads").json()["loads"]  # tests/server/test_loads.py: the shape
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0


def test_flush_cache(http):
    for resp in (
        http.get("/flush_cache"),
        http.post("/flush_cache"),
        http.post("/flush_cache?timeout=1"),
    ):
        assert resp.status_code == 200, resp.text
        assert resp.json()["success"] is True and isinstance(resp.json()["entries_cleared"], int)
    assert http.post("/flush_cache", json={"timeout": "0.5"}).status_code == 200
    assert_error(http.get("/flush_cache?timeout=-1"), 400, "validation_error")
    # Busy: a long request holds KV, so a flush without waiting is refused, SGLang-style.
    rid = http.post("/submit", json={"input_ids": [3] * 8, "sampling_params": LONG}).json()
    wait_until_running(http)
    busy = http.get("/flush_cache")
    http.post("/abort_request", json={"abort_all": True})
    http.get(f"/result/{rid['request_id']}")
    assert busy.status_code == 400, busy.text
    body = busy.json()
    assert body["success"] is False and "KV" in body["message"]
    assert body["error"]["status"] == 400 and body["error"]["retryable"] is True
    assert http.get("/flush_cache?timeout=10").status_code == 200


def test_paused_generate_is_503_and_abort_answers_200(http):
    results: list = []
    body = {"input_ids": [4] * 8, "sampling_params": LONG}
    waiter = threading.Thread(target=lambda: results.append(http.post("/generate", json=body)))
    waiter.start()
    wait_until_running(http)
    try:
        assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        waiter.join(60)
        (resp,) = results
        assert resp.status_code == 200, resp.text  # what slime expects of an abort pause
        assert resp.json()["meta_info"]["finish_reason"]["type"] == "abort"
        err = assert_error(http.post("/generate", json={"input_ids": [1]}), 503, "paused")
        assert err["retryable"] is True
        assert_error(http.post("/submit", json={"input_ids": [1]}), 503, "paused")
        ready = http.get("/ready")
        assert ready.status_code == 503 and "paused" in ready.json()["reasons"]
        assert http.get("/health_generate").status_code == 503
        assert http.get("/flush_cache").status_code == 200  # legal while paused
    finally:
        http.post("/continue_generation", json={})
    assert http.get("/ready").status_code == 200
    assert http.post("/generate", json={"input_ids": [1]}).status_code == 200


def test_litestar_errors_have_the_shape(http):
    err = assert_error(http.get("/no/such/route"), 404, "not_found")
    assert "/no/such/route" in err["message"]
    assert_error(http.get("/generate"), 405, "method_not_allowed")
    assert_error(http.delete("/health"), 405, "method_not_allowed")
    # An unknown route is a 404 whatever the method, one path segment or more (the OpenAPI
    # router's catch-all page answered GET /x with HTML and POST /x with 405).
    for method in ("GET", "POST", "PUT", "DELETE"):
        for path in ("/no_such_route", "/load_lora_adapter_from_somewhere", "/a/b"):
            assert_error(http.request(method, path, json={}), 404, "not_found")
    assert http.get("/docs").status_code == 200 and http.get("/openapi.json").status_code == 200


def test_server_info_names_where_it_serves(http):
    body = http.get("/get_server_info").json()
    assert (body["host"], body["port"]) == ("127.0.0.1", 8000)  # the flags' values
    assert body["nnodes"] == 1 and body["node_rank"] == 0
    assert body["base_gpu_id"] == 0 and body["gpu_id_step"] == 1


def test_server_info_bound_to_every_interface_names_the_address_reached():
    with app_server("--host", "0.0.0.0", "--port", "30123") as srv, srv.client() as c:
        body = c.get("/server_info").json()
    assert (body["host"], body["port"]) == ("127.0.0.1", 30123)


def test_parallelism_config(http):
    body = http.get("/parallelism_config", params={"rank": 0}).json()
    sizes = {k: v for k, v in body.items() if k.endswith("_size")}
    assert set(sizes.values()) == {1} and len(sizes) == 7 and body["world_size"] == 1
    assert {v for k, v in body.items() if k.endswith("_rank")} == {0}
    assert http.get("/parallelism_config").json() == body
    assert_error(http.get("/parallelism_config", params={"rank": 2}), 400, "validation_error")


@pytest.mark.parametrize(
    "path",
    ["/get_remote_instance_transfer_engine_info", "/load_lora_adapter",
     "/update_weights_from_ipc", "/send_weights_to_remote_instance"],
)  # fmt: skip
def test_transports_grctl_lacks_are_501_naming_what_to_use(http, path):
    for reply in (http.get(path), http.post(path, json={"lora_name": "x"})):
        err = assert_error(reply, 501, "not_supported")
        assert path in err["message"] and "/update_weights_from_" in err["message"]
        assert reply.json()["success"] is False


def test_openapi_lists_the_bodies(http):
    schema = http.get("/schema/openapi.json").json()
    names = set(schema["components"]["schemas"])
    assert {
        "GenerateBody",
        "SamplingParamsBody",
        "GenerateResponse",
        "SubmitManyBody",
        "CancelBody",
        "AbortRequestBody",
        "FlushCacheBody",
        "PollResponse",
        "ErrorResponse",
    } <= names
    ref = schema["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]
    assert "GenerateBody" in str(ref["schema"])
    sampling = schema["components"]["schemas"]["SamplingParamsBody"]["properties"]
    assert {"max_new_tokens", "n", "temperature", "stop_token_ids"} <= set(sampling)


@pytest.mark.parametrize("how", ["query", "body"])
def test_flush_cache_never_waits_whatever_its_timeout(http, how):
    """The guide: a timeout "is accepted but the server returns immediately and never blocks"
    (a parked flush holds a worker thread every blocking route needs). Huge and infinite
    timeouts are accepted and ignored; nan and negative ones are a 400, never a 500."""

    def flush(timeout: str):
        if how == "query":
            return http.get(f"/flush_cache?timeout={timeout}")
        return http.post("/flush_cache", content=f'{{"timeout": "{timeout}"}}')

    for timeout in ("1e10", "inf"):
        assert flush(timeout).status_code == 200, timeout  # idle: flushed
    for timeout in ("nan", "-1"):
        assert_error(flush(timeout), 400, "validation_error")
    rid = http.post("/submit", json={"input_ids": [3] * 8, "sampling_params": LONG}).json()
    wait_until_running(http)
    # Paused in_place, the request keeps its KV for as long as the pause lasts.
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        for timeout in ("15", "1e10", "inf"):
            t0 = time.monotonic()
            busy = flush(timeout)
            assert time.monotonic() - t0 < 2 and busy.status_code == 400, busy.text
            assert busy.json()["error"]["code"] == "cache_busy"
    finally:
        http.post("/continue_generation")
        http.post("/abort_request", json={"abort_all": True})
        http.get(f"/result/{rid['request_id']}")


def test_result_timeouts_out_of_range_are_a_400_or_clamped(http):
    rid = http.post("/submit", json={"input_ids": [1, 2], "sampling_params": {}}).json()
    for timeout in ("1e10", "inf"):  # clamped to --generate-timeout-s: waits for the request
        done = http.get(f"/result/{rid['request_id']}?timeout={timeout}")
        assert done.status_code == 200, done.text
        rid = http.post("/submit", json={"input_ids": [1, 2], "sampling_params": {}}).json()
    assert_error(http.get(f"/result/{rid['request_id']}?timeout=nan"), 400, "validation_error")
    assert http.get(f"/result/{rid['request_id']}?timeout=60").status_code == 200
