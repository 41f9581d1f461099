"""verl's own rollout code generating through a real `grctl serve` (`rollout.name=grctl`,
grctl/integrations/verl.py), on a local Ray.

verl finds the rollout by name: its LLMServerManager builds the replica from its registry, its
load balancer routes, its LLMServerClient (and FullyAsyncLLMServerClient, which resumes aborted
requests) calls the server actor; the trainer side is the adapter its registry gives, called in
the order verl's hybrid sync calls it. Every token is held to transformers' greedy output of the
weights the reply names. The trainer's worker group (FSDP on GPUs) is the one part stood in for:
the replica takes only its size. Skipped without verl and ray (`pip install --no-deps
verl==0.9.1` and the modules its rollout imports: .ci/run).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import tomllib
import torch

from tests.support.reference import hf_generate
from tests.support.serverproc import REPO_ROOT
from tests.support.trainer_side import hf_state

PLUGIN = "grctl.integrations.verl"
ray = pytest.importorskip("ray")
pytest.importorskip("verl.workers.rollout.llm_server")
pytest.importorskip(PLUGIN)  # here as verl's plugin loading does (test_verl_finds_grctl_by_name)
from omegaconf import OmegaConf  # noqa: E402  (verl's dependency: only once verl imports)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPT = [5, 9, 2, 77, 31, 4]
RESPONSE = 4


def rollout_config(url: str, **overrides) -> OmegaConf:
    """verl's own rollout.yaml, named grctl, one replica on one device."""
    import verl

    yaml = Path(verl.__file__).parent / "trainer" / "config" / "rollout" / "rollout.yaml"
    root = OmegaConf.create(
        {
            "trainer": {"n_gpus_per_node": 1},
            "data": {"max_prompt_length": 16, "max_response_length": RESPONSE},
            "actor_rollout_ref": {"model": {"path": "unused"}, "rollout": OmegaConf.load(yaml)},
        }
    )
    mine = {
        "profiler": None,  # its defaults name the actor's profiler config, which is not here
        "name": "grctl",
        "tensor_model_parallel_size": 1,
        "nnodes": 1,
        "calculate_log_probs": True,
        "custom": {"grctl": {"urls": [url], "sampling_params": {"ignore_eos": True}}},
        **overrides,
    }
    root.actor_rollout_ref.rollout = OmegaConf.merge(root.actor_rollout_ref.rollout, mine)
    OmegaConf.resolve(root)
    return root


@pytest.fixture(scope="module")
def srv(start_server, tiny_checkpoint):
    flags = ("--model-path", str(tiny_checkpoint), "--max-new-tokens", "256")
    return start_server(*flags, "--allow-weight-update")


@pytest.fixture(scope="module")
def local_ray():
    tmp = tempfile.mkdtemp(prefix="grctl-ray-")  # short: Ray's socket paths must fit 107 bytes
    # Ray's workers import verl's plugin as verl's own workers do; no token file in $HOME
    env = {"VERL_USE_EXTERNAL_MODULES": PLUGIN, "RAY_AUTH_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
    )
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # read by ray.init in this process
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=tmp,
            runtime_env={"env_vars": env},
        )
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture(scope="module")
def manager(local_ray, srv):
    from verl.workers.rollout.llm_server import LLMServerManager

    trainer = SimpleNamespace(world_size=1, workers=[None])  # the hybrid trainer's worker group
    return LLMServerManager.create(rollout_config(srv.url), worker_group=trainer)


def greedy_params(**kw) -> dict:
    """What verl's agent loop sends (temperature 0: its greedy, validation form)."""
    return dict(temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True, **kw)


@torch.no_grad()
def hf_logprobs(ckpt: Path, tokens: list[int]) -> list[float]:
    from tests.support.checkpoints import load_hf

    hf = load_hf(ckpt)
    logits = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1)
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


def test_verl_finds_grctl_by_name():
    """At `import verl`, in a fresh process: the plugin verl loads registers both halves."""
    code = (
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "print(get_rollout_replica_class('grctl').__name__, "
        "get_rollout_class('grctl', 'async').__name__)"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": PLUGIN}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["GrctlReplica", "GrctlServerAdapter"], out.stderr[-2000:]
    # the same module is what grctl's entry point names for verl's plugin discovery
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert declared["entry-points"]["verl.plugins"] == {"grctl": PLUGIN}
    installed = [ep for ep in entry_points(group="verl.plugins") if ep.name == "grctl"]
    assert all(ep.value == PLUGIN for ep in installed)


def test_verls_client_generates_through_grctl(manager, srv, tiny_checkpoint):
    (replica,) = manager.get_replicas()
    assert type(replica).__name__ == "GrctlReplica"
    assert manager.get_addresses() == [srv.url.removeprefix("http://")]
    out = asyncio.run(
        manager.get_client().generate("r1", prompt_ids=PROMPT, sampling_params=greedy_params())
    )
    want = hf_generate(tiny_checkpoint, PROMPT, RESPONSE)  # the response budget, all of it
    assert out.token_ids == want and out.stop_reason == "length"
    assert out.log_probs == pytest.approx(hf_logprobs(tiny_checkpoint, want), abs=1e-4)
    assert out.extra_fields["weight_version"] == "default"


def test_verls_hybrid_sync_pushes_new_weights(manager, srv, checkpoint):
    """release -> resume(weights) -> update_weights(global_steps=3) -> resume(kv_cache), as
    verl's trainer worker calls its rollout adapter; then verl's client sees step 3's weights."""
    from verl.workers.rollout.base import get_rollout_class

    new = checkpoint(seed=1)
    rollout = rollout_config(srv.url).actor_rollout_ref.rollout
    adapter = get_rollout_class("grctl", "async")(
        config=rollout, model_config=SimpleNamespace(path=str(new)), device_mesh=None
    )

    async def sync() -> None:
        await adapter.release()
        await adapter.resume(tags=["weights"])
        await adapter.update_weights(iter(hf_state(new)), global_steps=3)
        await adapter.resume(tags=["kv_cache"])

    asyncio.run(sync())
    assert httpx.get(srv.url + "/get_weight_version").json()["weight_version"] == "3"
    client = manager.get_client()
    out = asyncio.run(client.generate("r2", prompt_ids=PROMPT, sampling_params=greedy_params()))
    assert out.token_ids == hf_generate(new, PROMPT, RESPONSE)
    assert out.extra_fields["global_steps"] == 3
    with pytest.raises(ValueError, match="delta"):
        asyncio.run(adapter.update_weights(iter([]), wire_format="delta_flush"))


def test_aborted_rollout_resumes_to_the_unaborted_answer(manager, srv, checkpoint):
    """verl's partial rollout: abort_all_requests mid-request, then resume_generation; its
    FullyAsyncLLMServerClient continues from the tokens it has, and the whole is the greedy
    answer an uninterrupted request gives (same weights)."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    (replica,) = manager.get_replicas()
    client = manager.get_client(FullyAsyncLLMServerClient)
    long = 160
    aborted = httpx.get(srv.url + "/status").json()["requests"]["aborted"]

    async def run() -> tuple:
        task = asyncio.create_task(
            client.generate("r3", prompt_ids=PROMPT, sampling_params=greedy_params(max_tokens=long))
        )
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        await replica.abort_all_requests()
        await asyncio.sleep(1.5)  # verl retries an aborted request after 1 s: it waits, paused
        paused = httpx.get(srv.url + "/ready").json()["paused"]
        await replica.resume_generation()
        return await task, paused

    out, paused = asyncio.run(run())
    assert paused  # the retry waited for resume_generation
    assert httpx.get(srv.url + "/status").json()["requests"]["aborted"] == aborted + 1
    assert out.token_ids == hf_generate(checkpoint(seed=1), PROMPT, long)
    assert len(out.log_probs) == long and out.stop_reason == "length"
