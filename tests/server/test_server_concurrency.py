"""64 concurrent /generate calls: each answers what the same request answers alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.timeout(180)


def request(i: int) -> dict:
    # Different prompt lengths, beam widths and output lengths, so batches mix shapes.
    return {
        "input_ids": [(7 * i + j) % 250 + 3 for j in range(2 + i % 7)],
        "sampling_params": {"max_new_tokens": 1 + i % 4, "n": (1, 2, 4)[i % 3]},
        "return_logprob": i % 5 == 0,
        "rid": f"conc-{i}",
    }


def essence(reply: dict) -> tuple:
    meta = reply["meta_info"]
    beams = tuple(tuple(b["output_ids"]) for b in meta["beam_results"])
    return tuple(reply["output_ids"]), beams, meta["finish_reason"]["type"]


def test_64_concurrent_generates_match_sequential(builtin_server):
    bodies = [request(i) for i in range(64)]
    with builtin_server.client() as http:
        alone = [http.post("/generate", json=b).json() for b in bodies]

    def call(body: dict) -> dict:
        with builtin_server.client() as client:  # one connection per thread
            resp = client.post("/generate", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    with ThreadPoolExecutor(64) as pool:
        together = list(pool.map(call, bodies))

    for body, a, t in zip(bodies, alone, together, strict=True):
        assert t["meta_info"]["id"] == body["rid"]
        assert essence(t) == essence(a), body
        scores_a = [b["meta_info"]["sequence_score"] for b in a["meta_info"]["beam_results"]]
        scores_t = [b["meta_info"]["sequence_score"] for b in t["meta_info"]["beam_results"]]
        assert scores_t == pytest.approx(scores_a, abs=1e-4)
        if body["return_logprob"]:
            lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
            lp_t = [x[0] for x in t["meta_info"]["output_token_logprobs"]]
            assert lp_t == pytest.approx(lp_a, abs=1e-4)


def test_status_metrics_loads_while_requests_finish(builtin_server):
    """The worker drops a finished request's KV while /status, /metrics and /v1/loads read the
    running set: every read answers 200 (once an AttributeError -> 500 race)."""
    stop = threading.Event()
    statuses: list[int] = []

    def hammer(path: str) -> None:
        with builtin_server.client() as http:
            while not stop.is_set():
                statuses.append(http.get(path).status_code)

    bodies = [request(i) for i in range(160)]
    for body in bodies:
        body["rid"] = None
        body["sampling_params"]["n"] = 8
    with ThreadPoolExecutor(4) as readers, builtin_server.client() as http:
        futures = [readers.submit(hammer, p) for p in ("/status", "/metrics", "/v1/loads")]
        try:
            rids = []
            for start in range(0, len(bodies), 4):  # all queued first: many finish per step
                resp = http.post("/submit_many", json={"requests": bodies[start : start + 4]})
                assert resp.status_code == 202, resp.text
                rids += resp.json()["request_ids"]
            for rid in rids:
                assert http.get(f"/result/{rid}", params={"timeout": 60}).status_code == 200
        finally:
            stop.set()
            for f in futures:
                f.result()
    assert len(statuses) > 100 and set(statuses) == {200}, sorted(set(statuses))
