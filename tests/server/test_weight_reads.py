"""Reads of the live weights (/get_weights_by_name, /weights_checker) against updates running
at the same time on a real server: every read sees one whole checkpoint, never half of each."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import load_hf
from tests.support.serverproc import running_server
from tests.support.weight_helpers import checkpoint_sha256, served_sha256

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

# Big enough that one update's copies take milliseconds, so a read can land inside one.
SHAPE = dict(hidden_size=256, intermediate_size=512, vocab_size=8192, head_dim=64)


@pytest.fixture(scope="module")
def ckpts(checkpoint) -> dict[str, Path]:
    return {v: checkpoint(seed=s, **SHAPE) for v, s in (("a", 31), ("b", 32))}


def test_reads_never_see_a_half_written_model(ckpts):
    sums = {v: checkpoint_sha256(p) for v, p in ckpts.items()}
    embed = {v: load_hf(p).model.embed_tokens.weight.detach() for v, p in ckpts.items()}
    assert sums["a"] != sums["b"]
    args = ("--allow-weight-update", "--model-path", str(ckpts["a"]))
    with running_server(*args) as srv, srv.client() as http:
        stop, updates = threading.Event(), [0]

        def update_forever() -> None:
            with srv.client() as writer:
                while not stop.is_set():
                    v = "ab"[updates[0] % 2]
                    body = {"model_path": str(ckpts[v]), "weight_version": v}
                    resp = writer.post("/update_weights_from_disk", json=body)
                    assert resp.status_code == 200, resp.text
                    updates[0] += 1
                    stop.wait(0.02)  # a lock is not fair: leave the readers a turn

        thread = threading.Thread(target=update_forever)
        thread.start()
        try:
            for _ in range(6):
                got = served_sha256(http)
                assert got in (sums["a"], sums["b"]), "a checksum mixed two checkpoints"
                body = {"name": "model.embed_tokens.weight", "truncate_size": SHAPE["vocab_size"]}
                resp = http.post("/get_weights_by_name", json=body)
                assert resp.status_code == 200, resp.text
                rows = torch.tensor(resp.json()["parameter"])
                assert any(torch.equal(rows, e) for e in embed.values()), "a torn embedding"
        finally:
            stop.set()
            thread.join()
        assert updates[0] >= 4
