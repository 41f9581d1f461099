"""Soak, short version (bench/soak.py is the long one): four client threads call /generate
without pause while a trainer loop runs sync cycles on a real server, alternating disk and tensor
transports and the abort, retract and in_place pause modes over three checkpoints whose greedy
outputs identify them.

It proves, for every answer: no 5xx but 503 `paused` (retryable); a 200's output_ids are
transformers' greedy outputs of the checkpoint its meta_info.weight_version names; more than one
version in the weight_versions spans only across in_place or retract cycles, with the outputs
transformers gives token by token when each span's tokens come from its checkpoint (at each
change in_place continues on the old KV, retract on KV the new checkpoint recomputed);
finish_reason abort only across an abort-mode pause. And for the server: RssAnon after warm-up
grows < 5%, open fds and shared-memory segments (its own maps, the trainer's /dev/shm segments)
do not grow, the served checksums are the last checkpoint's, and nothing in its log is a
traceback. GRCTL_SOAK_S sets the duration (default 45 s).
"""

from __future__ import annotations

import json
import os

import pytest

from bench.soak import MODES, TRANSPORTS, SoakConfig, run_soak

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_soak_generation_during_sync_cycles(tmp_path):
    cfg = SoakConfig(duration_s=float(os.environ.get("GRCTL_SOAK_S", "45")), sample_every_s=5.0)
    report = run_soak(cfg, tmp_path)
    summary = {k: v for k, v in report.items() if k != "samples"}
    assert report["violations"] == [], json.dumps(summary, indent=1)
    # The run covered what it claims to: every transport x mode, every kind of answer.
    kinds = {f"{t}/{m}" for t in TRANSPORTS for m in MODES}
    assert set(report["cycles_by_kind"]) == kinds, report["cycles_by_kind"]
    assert report["num_cycles"] >= 60, summary
    req = report["requests"]
    complete = req["ok"] + req["ok_across_retract"] + req["recomputed_across_retract"]
    assert complete >= 50, req
    assert req["aborted"] >= 1 and req["mixed_in_place"] >= 1 and req["paused_503"] >= 1, req
    assert req["recomputed_across_retract"] >= 1, req  # a retract kept tokens and continued
    assert report["final_checksum_ok"] is True
    growth = report["resources"]["growth"]
    assert growth["rss_anon_pct"] < 5.0 and growth["fds"] <= 2, growth
    assert growth["server_shm_maps"] <= 2 and growth["client_shm_segments"] <= 2, growth
