"""Pushing tensors a trainer holds in memory to a real server (its own process): transformers'
Qwen3, perturbed in this process, pushed by WeightSync.run and GRClient.push_tensors without any
checkpoint written; the server then generates what transformers generates on those weights,
labels every reply with the pushed version, and its checksums are the tensors' own sha256."""

from __future__ import annotations

import pytest
import torch

from grctl.client import GRClient, SyncError, WeightSync
from grctl.client.sources import NamedTensors
from grctl.errors import ValidationError
from grctl.weights.checker import tensor_sha256
from tests.support.checkpoints import load_hf
from tests.support.reference import hf_generate
from tests.support.weight_helpers import PROMPTS, served_by_client, served_sha256

pytestmark = pytest.mark.timeout(180)
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint(seed=31)


@pytest.fixture(scope="module")
def srv(start_server, base):
    return start_server("--allow-weight-update", "--model-path", str(base))


def trained(base, step: int):
    """The trainer's model after `step` steps: the base weights moved by seeded noise."""
    hf = load_hf(base)
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return hf


def own_sha256(hf) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in hf.state_dict().items()}


def test_state_dict_pushed_by_weight_sync(srv, http, base):
    hf = trained(base, step=1)
    with WeightSync(srv.url, bucket_mb=0.01, verify=True) as sync:
        result = sync.run(hf.state_dict(), weight_version="step-1")
    (out,) = result.servers
    assert result.ok and out.resumed and out.verified and out.weight_version == "step-1"
    assert result.num_buckets > 5 and out.num_buckets == result.num_buckets
    assert result.checkpoint == f"{len(hf.state_dict())} tensors in memory"
    assert served_sha256(http) == own_sha256(hf)
    for prompt in PROMPTS:
        assert served_by_client(srv.url, prompt, NEW_TOKENS) == (
            hf_generate(hf, prompt, NEW_TOKENS),
            "step-1",
        )


def test_pairs_from_a_generator_with_bf16_tensors(srv, http, base):
    """A generator of pairs is taken whole; bfloat16 tensors are cast to the served float32."""
    hf = trained(base, step=2).to(torch.bfloat16)
    pairs = ((n, t) for n, t in hf.state_dict().items())
    with WeightSync(srv.url, bucket_mb=0.05) as sync:
        result = sync.run(pairs, weight_version="step-2")
    assert result.ok and result.servers[0].resumed
    want = {n: tensor_sha256(t.float()) for n, t in hf.state_dict().items()}
    assert served_sha256(http) == want


def test_partial_state_dict_is_refused_before_any_pause(srv, http, base):
    with GRClient(srv.url) as gr:
        before = gr.get_weight_version()
    sums = served_sha256(http)
    state = trained(base, step=3).state_dict()
    state.pop("model.layers.1.mlp.down_proj.weight")
    with WeightSync(srv.url, bucket_mb=0.01) as sync, pytest.raises(SyncError) as info:
        sync.run(state, weight_version="never")
    (out,) = info.value.result.servers
    assert out.failed_stage == "plan" and not out.paused and out.num_buckets == 0
    assert "layers.1.mlp.down_proj.weight" in out.error
    with GRClient(srv.url) as gr:
        after = gr.get_weight_version()
        assert gr.ready().ready
    assert after.weight_version == before.weight_version
    assert after.weight_update_count == before.weight_update_count
    assert served_sha256(http) == sums


def test_grclient_push_tensors_inside_the_callers_pause(srv, http, base):
    hf = trained(base, step=4)
    with GRClient(srv.url) as gr:
        gr.pause_generation()
        gr.flush_cache_until_ok()
        result = gr.push_tensors(NamedTensors(hf.state_dict()), bucket_mb=0.02, weight_version=4)
        gr.continue_generation()
        reply = gr.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
    (out,) = result.servers
    assert out.ok and out.num_buckets == result.num_buckets > 1
    assert out.num_tensors == len(hf.state_dict())
    assert served_sha256(http) == own_sha256(hf)
    assert reply.output_ids == hf_generate(hf, PROMPTS[0], NEW_TOKENS)
    assert reply.meta_info.weight_version == "4"


def test_not_pairs_and_disk_transport_are_refused(srv):
    with WeightSync(srv.url) as sync:
        with pytest.raises(ValidationError, match="pairs"):
            sync.run([torch.zeros(3)])
        with pytest.raises(ValidationError, match="given twice"):
            sync.run([("model.norm.weight", torch.zeros(3))] * 2)
    with WeightSync(srv.url, transport="disk") as sync:
        with pytest.raises(ValidationError, match="transport='tensor'"):
            sync.run({"model.norm.weight": torch.zeros(3)})


@pytest.mark.gpu
def test_cuda_state_dict_to_a_cpu_server(srv, http, base):
    hf = trained(base, step=5).cuda()
    with WeightSync(srv.url, bucket_mb=0.05, verify=True) as sync:
        result = sync.run(hf.state_dict(), weight_version="cuda-5")
    assert result.ok and result.servers[0].verified
    assert served_sha256(http) == own_sha256(hf)
