"""The serving routes of protocol.md, in process on the built-in model (Litestar's test client)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(120)


def generate(http: httpx.Client, input_ids, **kw) -> dict:
    body = {"input_ids": input_ids, "sampling_params": kw.pop("sampling_params", {}), **kw}
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_health_and_ready(http):
    assert http.get("/health").json() == {"ok": True}
    resp = http.get("/ready")
    assert resp.status_code == 200
    body = resp.json()
    assert body["ready"] is True and body["reasons"] == [] and body["paused"] is False


def test_generate_greedy_shape(http):
    out = generate(http, [1, 2, 3], sampling_params={"max_new_tokens": 3}, rid="greedy-1")
    ids, meta = out["output_ids"], out["meta_info"]
    assert len(ids) == 3 and all(isinstance(t, int) for t in ids)
    assert out["text"] == " ".join(map(str, ids))  # no tokenizer: ids joined by spaces
    assert meta["id"] == "greedy-1"
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
    assert meta["weight_version"] == "default" and meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": 3}
    ]
    assert meta["beam_width"] == 1 and len(meta["beam_results"]) == 1
    assert meta["beam_results"][0]["output_ids"] == ids
    assert "output_token_logprobs" not in meta
    # [[S]] is a batch of one (a list of one reply, as in SGLang) of the same prompt; numbers as
    # strings and unknown keys are accepted.
    (again,) = generate(
        http,
        [[1, 2, 3]],
        sampling_params={"max_new_tokens": "3", "temperature": "0", "skip_special_tokens": True},
        unknown_key={"x": 1},
    )
    assert again["output_ids"] == ids


def test_generate_beams_and_logprobs(http):
    out = generate(http, [5, 6, 7], sampling_params={"max_new_tokens": 4, "n": 4})
    meta = out["meta_info"]
    beams = meta["beam_results"]
    assert meta["beam_width"] == 4 and len(beams) == 4
    scores = [b["meta_info"]["sequence_score"] for b in beams]
    assert scores == sorted(scores, reverse=True)
    assert out["output_ids"] == beams[0]["output_ids"]
    assert all(b["meta_info"]["finish_reason"]["type"] == "length" for b in beams)
    assert len({tuple(b["output_ids"]) for b in beams}) == 4

    out = generate(http, [5, 6, 7], sampling_params={"max_new_tokens": 4}, return_logprob=True)
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(lp <= 0.0 and text is None for lp, _, text in lps)


def test_generate_stop_token(http):
    first = generate(http, [9, 9, 9], sampling_params={"max_new_tokens": 4})["output_ids"]
    out = generate(
        http, [9, 9, 9], sampling_params={"max_new_tokens": 4, "stop_token_ids": [first[1]]}
    )
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] == first[1]
    n = len(out["output_ids"])  # the sequence ends at the stop token (kept or trimmed)
    assert 1 <= n <= 2 and out["output_ids"] == first[:n]
    ignored = generate(
        http,
        [9, 9, 9],
        sampling_params={"max_new_tokens": 4, "stop_token_ids": [first[1]], "ignore_eos": True},
    )
    assert ignored["output_ids"] == first


@pytest.mark.parametrize(
    "body",
    [
        {},  # no prompt
        {"input_ids": []},
        {"input_ids": [[1, 2], []]},  # a batch with an empty prompt
        {"input_ids": [[1, 2], [3]], "rid": ["a"]},  # one rid for two prompts
        {"input_ids": [[1, 2], [3]], "rid": "a"},  # a batch takes a list of rids
        {"input_ids": [1, 2], "rid": ["a"]},  # one prompt takes a string
        {"input_ids": [[1, 2], [3]], "sampling_params": [{}, {}, {}]},
        {"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"n": 0}]},
        {"input_ids": [1, [2]]},
        {"input_ids": "1 2 3"},
        {"input_ids": [-1]},
        {"input_ids": [10**9]},  # past the vocabulary
        {"input_ids": [1.5]},
        {"input_ids": [1], "text": "hi"},
        {"text": "hello"},  # no tokenizer in the built-in model
        {"input_ids": [1], "sampling_params": {"n": 0}},
        {"input_ids": [1], "sampling_params": {"n": 100000}},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 100000}},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": "lots"}},
        {"input_ids": [1], "sampling_params": {"top_p": 0}},
        {"input_ids": [1], "sampling_params": {"temperature": -1}},
        {"input_ids": [1], "sampling_params": "greedy"},
        {"input_ids": [1], "return_logprob": "maybe"},
        {"input_ids": [1], "stream": True},
        [1, 2, 3],  # not an object
    ],
)
def test_generate_validation_errors(http, body):
    assert_error(http.post("/generate", json=body), 400, "validation_error")


def test_malformed_json_and_empty_body(http):
    for content in (b"{", b"{'input_ids': [1]}", b"\xff\xfe", b"null null"):
        resp = http.post("/generate", content=content, headers={"content-type": "application/json"})
        assert_error(resp, 400, "validation_error")
    assert_error(http.post("/generate"), 400, "validation_error")  # empty: defaults, no prompt


def test_submit_poll_result_matches_generate(http):
    want = generate(http, [4, 3, 2], sampling_params={"max_new_tokens": 3, "n": 2})
    resp = http.post(
        "/submit",
        json={"input_ids": [4, 3, 2], "sampling_params": {"max_new_tokens": 3, "n": 2}},
    )
    assert resp.status_code == 202, resp.text
    rid = resp.json()["request_id"]
    deadline = time.monotonic() + 30
    while not (polled := http.get(f"/poll/{rid}").json())["ready"]:
        assert polled["response"] is None and time.monotonic() < deadline
        time.sleep(0.01)
    assert polled["response"]["output_ids"] == want["output_ids"]
    got = http.get(f"/result/{rid}")
    assert got.status_code == 200 and got.json()["output_ids"] == want["output_ids"]


def test_submit_errors(http):
    body = {"input_ids": [1, 2], "request_id": "dup-1", "sampling_params": {"max_new_tokens": 1}}
    assert http.post("/submit", json=body).status_code == 202
    assert_error(http.post("/submit", json=body), 409, "duplicate_request_id")
    assert_error(http.post("/submit", json={"input_ids": "x"}), 400, "validation_error")
    http.get("/result/dup-1")
    assert_error(http.get("/poll/no-such-request"), 404, "not_found")
    assert_error(http.get("/result/no-such-request"), 404, "not_found")


def test_submit_many(http):
    rows = [{"input_ids": [i, i + 1], "sampling_params": {"max_new_tokens": 2}} for i in range(3)]
    resp = http.post("/submit_many", json={"requests": rows})
    assert resp.status_code == 202, resp.text
    ids = resp.json()["request_ids"]
    assert len(ids) == 3
    for rid, row in zip(ids, rows, strict=True):
        assert (
            http.get(f"/result/{rid}").json()["output_ids"] == generate(http, **row)["output_ids"]
        )
    assert http.post("/submit_many", json={}).json() == {"request_ids": []}
    # More than --max-http-submit-many (4), one bad row, or a repeated id: nothing is queued.
    many = [{"input_ids": [1], "request_id": f"many-{i}"} for i in range(5)]
    assert_error(http.post("/submit_many", json={"requests": many}), 413, "payload_too_large")
    for bad_row in ({"input_ids": [-5]}, {"input_ids": [10**6]}, {"input_ids": [1], "text": "x"}):
        bad = [{"input_ids": [1], "request_id": "ok-row"}, bad_row]
        assert_error(http.post("/submit_many", json={"requests": bad}), 400, "validation_error")
    # A row whose id is already taken fails at submit: the rows before it are taken back.
    assert http.post("/submit", json={"input_ids": [1], "request_id": "taken"}).status_code == 202
    clash = [{"input_ids": [1], "request_id": "ok-row"}, {"input_ids": [1], "request_id": "taken"}]
    assert_error(http.post("/submit_many", json={"requests": clash}), 409, "duplicate_request_id")
    http.get("/result/taken")
    dup = [{"input_ids": [1], "request_id": "same"}] * 2
    assert_error(http.post("/submit_many", json={"requests": dup}), 409, "duplicate_request_id")
    for rid in ("many-0", "ok-row", "same"):
        assert_error(http.get(f"/poll/{rid}"), 404, "not_found")


def test_cancel_and_abort(http):
    long = {"max_new_tokens": 64, "n": 32, "ignore_eos": True}
    rid = http.post("/submit", json={"input_ids": [1] * 8, "sampling_params": long}).json()
    rid = rid["request_id"]
    resp = http.post("/cancel", json={"request_id": rid})  # a LONG request: still in flight
    assert resp.status_code == 200 and resp.json() == {"request_id": rid, "cancelled": True}
    out = http.get(f"/result/{rid}").json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert_error(http.post("/cancel", json={}), 400, "validation_error")
    assert_error(http.post("/cancel", json={"request_id": "no-such"}), 404, "not_found")

    rid = http.post("/submit", json={"input_ids": [2] * 8, "sampling_params": long}).json()
    resp = http.post("/abort_request", json={"rid": rid["request_id"]})
    assert resp.json() == {"success": True, "num_aborted_requests": 1}
    out = http.get(f"/result/{rid['request_id']}").json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    # A finished request can no longer be cancelled, but it is known until fetched.
    assert http.post("/submit", json={"input_ids": [1], "request_id": "done-1"}).status_code == 202
    deadline = time.monotonic() + 30
    while not http.get("/poll/done-1").json()["ready"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    resp = http.post("/cancel", json={"rid": "done-1"})
    assert resp.json() == {"request_id": "done-1", "cancelled": False}
    assert http.get("/result/done-1").status_code == 200
    assert_error(http.post("/cancel", json={"request_id": "done-1"}), 404, "not_found")
    assert http.post("/abort_request", json={"rid": "no-such"}).json()["num_aborted_requests"] == 0
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    assert http.post("/abort_request").status_code == 200  # empty body: nothing to abort
