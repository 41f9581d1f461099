"""WeightSync against a fleet of real servers: chunked tensor pushes and disk loads reach one
version everywhere and generate exactly what transformers generates on the new checkpoint; a
server killed mid-sync fails alone while the others are resumed and serving; the library works
from a separate process."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack

import pytest
import torch

from grctl.client import GRClient, SyncError, WeightSync
from grctl.client.staging import MiB, plan_buckets
from grctl.errors import WeightValidationError
from grctl.weights.checkpoint import Checkpoint
from tests.support.checkpoints import write_checkpoint
from tests.support.reference import hf_generate
from tests.support.serverproc import REPO_ROOT, start_servers
from tests.support.weight_helpers import served_by_client

pytestmark = pytest.mark.timeout(180)
PROMPT = [1, 5, 9, 42, 7]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def ckpts(checkpoint):
    """seed 0 (what the servers start on) and seed 1 (what is pushed)."""
    return checkpoint(seed=0), checkpoint(seed=1)


@pytest.fixture(scope="module")
def fleet(ckpts):
    with ExitStack() as stack:
        yield start_servers(stack, 3, "--model-path", str(ckpts[0]), "--allow-weight-update")


def test_bucket_plan_respects_the_budget(ckpts):
    with Checkpoint(ckpts[1]) as ckpt:
        specs = ckpt.specs()
    plans = plan_buckets(specs, torch.bfloat16, int(0.01 * MiB))
    assert len(plans) > 5 and sum(len(p.entries) for p in plans) == len(specs)
    for p in plans:  # over budget only when one tensor alone is larger than it
        assert p.nbytes <= 0.01 * MiB or len(p.entries) == 1
    assert len(plan_buckets(specs, None, 1 << 62)) == 1


def test_chunked_tensor_push_to_a_fleet(fleet, ckpts):
    urls = [s.url for s in fleet]
    seen = []
    with WeightSync(urls, bucket_mb=0.01, verify=True, on_progress=seen.append) as sync:
        result = sync.run(ckpts[1], weight_version=1)
    assert result.ok and result.num_buckets > 5 and len(seen) == result.num_buckets
    assert seen[-1].bytes_done == result.num_bytes
    want = hf_generate(ckpts[1], PROMPT, NEW_TOKENS)
    for out in result.servers:
        assert out.resumed and out.verified and out.weight_version == "1"
        assert out.num_buckets == result.num_buckets and out.num_bytes == result.num_bytes
        assert served_by_client(out.url, PROMPT, NEW_TOKENS) == (want, "1")


def test_disk_push_to_a_fleet(fleet, ckpts):
    urls = [s.url for s in fleet]
    with WeightSync(urls, transport="disk", verify=True) as sync:
        result = sync.run(ckpts[0], weight_version="disk-0")
    assert result.ok and all(o.num_tensors > 0 for o in result.servers)
    want = hf_generate(ckpts[0], PROMPT, NEW_TOKENS)
    assert all(served_by_client(u, PROMPT, NEW_TOKENS) == (want, "disk-0") for u in urls)


def test_bad_checkpoint_keeps_every_server_on_its_version(fleet, tmp_path):
    wrong = write_checkpoint(tmp_path / "wide", seed=2, hidden_size=32)  # another structure
    before = [served_by_client(s.url, PROMPT, NEW_TOKENS) for s in fleet]
    with WeightSync([s.url for s in fleet], transport="disk") as sync:
        with pytest.raises(SyncError) as info:
            sync.run(wrong, weight_version="never")
    result = info.value.result
    assert all(o.failed_stage == "push" and o.resumed for o in result.servers)
    assert all(o.weight_version == o.old_version for o in result.servers)
    assert [served_by_client(s.url, PROMPT, NEW_TOKENS) for s in fleet] == before
    with WeightSync(fleet[0].url) as sync, pytest.raises(WeightValidationError):
        sync.run(tmp_path / "missing")  # refused before any server is paused
    with GRClient(fleet[0].url) as gr:
        assert gr.ready().ready


def test_server_killed_mid_sync(fleet, ckpts):
    with ExitStack() as stack:
        (doomed,) = start_servers(stack, 1, "--model-path", str(ckpts[0]), "--allow-weight-update")
        urls = [fleet[0].url, doomed.url, fleet[1].url]

        def kill_after_two(progress) -> None:
            if progress.buckets_done == 2:
                doomed.proc.kill()
                doomed.proc.wait()

        with WeightSync(urls, bucket_mb=0.01, on_progress=kill_after_two) as sync:
            with pytest.raises(SyncError) as info:
                sync.run(ckpts[1], weight_version="after-kill")
    message, result = str(info.value), info.value.result
    assert "failed on 1 of 3" in message and f"{doomed.url}: push failed" in message
    dead = result.servers[1]
    assert dead.failed_stage == "push" and not dead.resumed and dead.num_buckets == 2
    want = hf_generate(ckpts[1], PROMPT, NEW_TOKENS)
    for out in (result.servers[0], result.servers[2]):
        assert out.ok and out.resumed
        assert served_by_client(out.url, PROMPT, NEW_TOKENS) == (want, "after-kill")


def test_library_from_a_separate_process(fleet, ckpts):
    code = (
        "import sys\n"
        "from grctl.client import GRClient, WeightSync\n"
        "url, ckpt = sys.argv[1], sys.argv[2]\n"
        "with WeightSync(url, bucket_mb=0.05, verify=True) as sync:\n"
        "    r = sync.run(ckpt, weight_version='from-subprocess')\n"
        "with GRClient(url) as gr:\n"
        "    print(r.num_buckets, gr.get_weight_version().weight_version)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    url = fleet[2].url
    proc = subprocess.run(
        [sys.executable, "-c", code, url, str(ckpts[1])],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    num_buckets, version = proc.stdout.split()
    assert int(num_buckets) > 1 and version == "from-subprocess"
    want = hf_generate(ckpts[1], PROMPT, NEW_TOKENS)
    assert served_by_client(url, PROMPT, NEW_TOKENS) == (want, "from-subprocess")


def test_checkpoint_of_another_structure_is_refused_before_any_pause(ckpts, tmp_path):
    """One server of two serves another MLP size: the tensor path's plan refuses it before any
    server is paused, so it keeps serving its own weights; the other is updated."""
    other = write_checkpoint(tmp_path / "other", seed=2, intermediate_size=80)
    with ExitStack() as stack:
        good = start_servers(stack, 1, "--model-path", str(ckpts[0]), "--allow-weight-update")[0]
        odd = start_servers(stack, 1, "--model-path", str(other), "--allow-weight-update")[0]
        with pytest.raises(SyncError) as info:
            with WeightSync([good.url, odd.url], bucket_mb=0.01, verify=False) as sync:
                sync.run(ckpts[1], weight_version="next")
        outcomes = {o.url: o for o in info.value.result.servers}
        assert outcomes[good.url].ok and outcomes[good.url].resumed
        bad = outcomes[odd.url]
        assert bad.failed_stage == "plan" and not bad.paused and bad.num_buckets == 0
        assert "intermediate_size" in bad.error
        with GRClient(odd.url) as gr:
            assert gr.get_weight_version().weight_version == "default"
            assert gr.ready().ready
        want = hf_generate(other, PROMPT, NEW_TOKENS)
        assert served_by_client(odd.url, PROMPT, NEW_TOKENS) == (want, "default")
        want = hf_generate(ckpts[1], PROMPT, NEW_TOKENS)
        assert served_by_client(good.url, PROMPT, NEW_TOKENS) == (want, "next")
