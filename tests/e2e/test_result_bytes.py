"""Unfetched results are bounded by bytes on a real server: prompt-scoring results submitted and
never fetched hold at most --max-finished-result-bytes (the oldest are dropped, a fetch of one
is a 404 that says so), and the server's resident memory grows by about that bound, not by
what every result would hold (on the 2-core machine: +139-149 MiB peak with the bound, +270 MiB
with 6 results unbounded)."""

from __future__ import annotations

import time

import pytest

from tests.support.memory import peak_rss, reset_peak, rss
from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(300)

MiB = 2**20
BOUND = 48 * MiB
TOKENS, TOP = 1000, 256  # one result: 256,000 (logprob, id) pairs, ~35 MB as Python objects


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--max-finished-result-bytes", str(BOUND))


def scoring(i: int) -> dict:
    ids = [3 + (i + t) % 250 for t in range(TOKENS)]
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": TOP,
    }


def test_unfetched_results_are_bounded_by_bytes(srv, http):
    pid = srv.proc.pid
    http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
    before = rss(pid)
    reset_peak(pid)
    rids = []
    for i in range(8):
        rids.append(http.post("/submit", json=scoring(i)).json()["request_id"])
        while not http.get(f"/poll/{rids[-1]}").json()["ready"]:
            time.sleep(0.05)
    status = http.get("/status").json()["scheduler"]
    grown = peak_rss(pid) - before
    print(f"kept {status['retained_results']}: {status['retained_result_bytes'] / MiB:.0f} MiB,"
          f" peak RSS +{grown / MiB:.0f} MiB")  # fmt: skip
    assert status["retained_result_bytes"] <= BOUND
    assert status["evicted_results"] >= 6 and status["retained_results"] >= 1
    one = status["retained_result_bytes"] // status["retained_results"]
    # the kept one(s), the one being built and its lists, a ready /poll's reply built from it;
    # every result kept: ~+340 MiB
    assert grown < BOUND + 4 * one
    err = assert_error(http.get(f"/result/{rids[0]}"), 404, "not_found")
    assert "dropped unfetched" in err["message"] and "--max-finished-result-bytes" in err["message"]
    last = http.get(f"/result/{rids[-1]}").json()
    tops = last["meta_info"]["input_top_logprobs"]
    assert len(tops) == TOKENS and all(len(row) == TOP for row in tops[1:])
    assert http.get("/status").json()["scheduler"]["retained_result_bytes"] < BOUND
