"""WeightSync's auto transport on a real server on this host: a checkpoint is read by the server
itself (one copy, no staging), a path the server refuses falls back to staged buckets, and a
WeightSync plans each server once per source structure. Every push is checked against the
checkpoint's own tensors."""

from __future__ import annotations

import httpx
import pytest

from grctl.client import WeightSync, hosts
from tests.support.checkpoints import load_hf
from tests.support.weight_helpers import checkpoint_sha256, served_sha256

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ckpts(checkpoint):
    return {seed: checkpoint(seed=seed) for seed in (51, 52, 53)}


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    # reads from disk only under checkpoint 52's directory: 53 is refused (403)
    root = ckpts[52]
    return start_server("--allow-weight-update", "--model-path", str(ckpts[51]),
                        "--weights-root", str(root))  # fmt: skip


def requests(http: httpx.Client, route: str) -> int:
    """How many 200s the server has answered on `route` (its /metrics counter)."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("gr_http_requests_total{") and f'route="{route}"' in line:
            if 'status="200"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return int(total)


def test_local_urls():
    assert hosts.is_local("http://127.0.0.1:8000") and hosts.is_local("http://localhost:1")
    assert not hosts.is_local("http://192.0.2.7:8000")  # TEST-NET-1: no interface of ours


def test_auto_reads_on_the_server_and_falls_back_to_staging(srv, http, ckpts):
    disk, tensor = (
        requests(http, "/update_weights_from_disk"),
        requests(http, "/update_weights_from_tensor"),
    )
    with WeightSync(srv.url, verify=True) as sync:
        result = sync.run(str(ckpts[52]), weight_version="b")
        assert result.ok and result.transport == "disk" and result.num_buckets == 0
        assert served_sha256(http) == checkpoint_sha256(ckpts[52])
        assert requests(http, "/update_weights_from_disk") == disk + 1
        assert requests(http, "/update_weights_from_tensor") == tensor

        result = sync.run(str(ckpts[53]), weight_version="c")  # outside --weights-root: 403
        (out,) = result.servers
        assert result.ok and result.transport == "tensor" and out.num_buckets >= 1
        assert out.verified and served_sha256(http) == checkpoint_sha256(ckpts[53])
        assert requests(http, "/update_weights_from_tensor") > tensor


def test_staged_when_buckets_are_asked_for_and_planned_once(srv, http, ckpts):
    hf = load_hf(ckpts[52])
    before = requests(http, "/model_info")
    with WeightSync(srv.url, bucket_mb=0.01) as sync:
        result = sync.run(str(ckpts[52]), weight_version="s0")
        assert result.transport == "tensor" and result.num_buckets > 5
        for step in range(2):
            result = sync.run(hf.state_dict(), weight_version=f"s{step + 1}")
            assert result.ok and result.servers[0].resumed
    # planned once for the checkpoint, once for the state dict (another source structure)
    assert requests(http, "/model_info") - before == 2
