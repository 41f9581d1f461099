"""CUDA-only paths the CPU cannot run (skipped without CUDA): the engine's device bound in its
threads, graphs captured on a device other than cuda:0, disk loads through pinned buffers."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.weights import pinned
from grctl.weights.checkpoint import Checkpoint
from grctl.weights.disk import update_from_disk
from grctl.weights.updater import WeightUpdater
from grctl.weights.views import hf_state_dict
from tests.support.checkpoints import write_checkpoint
from tests.support.reference import hf_and_ours, rope_pair

pytestmark = pytest.mark.gpu


def last_device() -> str:
    return f"cuda:{torch.cuda.device_count() - 1}"


def test_worker_and_graphs_run_on_the_engines_device():
    device = last_device()  # cuda:1 on a machine with two GPUs: nothing may land on cuda:0
    model = hf_and_ours(seed=2, device=device)[1]
    seen = []
    eng = Engine(model, EngineConfig(device=device))
    real = eng.runner.decode
    eng.runner.decode = lambda items: seen.append(torch.cuda.current_device()) or real(items)
    eng.start()
    try:
        req = GenerateRequest((1, 2, 3, 4), SamplingParams(max_new_tokens=4, n=3))
        graphed = eng.generate(req, timeout=60)
    finally:
        eng.stop(drain=False)
    assert seen and set(seen) == {torch.device(device).index}
    assert eng.runner.graphs is not None and eng.runner.graphs.num_replays > 0
    eager = Engine(model, EngineConfig(device=device, cuda_graph=False))
    ids = eager.submit(req)
    while eager.run_step():
        pass
    assert [b.output_ids for b in eager.result(ids).beams] == [b.output_ids for b in graphed.beams]


def test_disk_update_on_cuda_goes_through_pinned_buffers(tmp_path):
    path = write_checkpoint(tmp_path / "new", seed=4)
    model = hf_and_ours(seed=1, device=last_device())[1]
    updater = WeightUpdater(Engine(model, EngineConfig(device=last_device(), cuda_graph=False)))
    update_from_disk(updater, str(path), weight_version="v2")
    assert torch.device(last_device()) in pinned._stagers
    with Checkpoint(path) as ckpt:
        live = hf_state_dict(model)
        names = [spec.name for spec in ckpt.specs()]
        for name in names:
            assert torch.equal(live[name].cpu(), ckpt.fetch(name).to(live[name].dtype)), name


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "llama3"])
def test_scaled_rope_decodes_through_cuda_graphs(kind):
    """Every RoPE type's frequencies are made on the device, so graph capture (which cannot copy
    from the host) succeeds, and graphed decode equals eager decode."""
    model = rope_pair(kind, "rope_parameters")[1].to(last_device())
    req = GenerateRequest(tuple(range(3, 50)), SamplingParams(max_new_tokens=4, n=3))
    eng = Engine(model, EngineConfig(device=last_device()))
    eng.start()
    try:
        graphed = eng.generate(req, timeout=60)
        assert eng.status()["engine"]["errors"] == 0 and eng.runner.graphs is not None
    finally:
        eng.stop(drain=False)
    eager = Engine(model, EngineConfig(device=last_device(), cuda_graph=False))
    rid = eager.submit(req)
    while eager.run_step():
        pass
    assert [b.output_ids for b in eager.result(rid).beams] == [b.output_ids for b in graphed.beams]
