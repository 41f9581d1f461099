"""verl-GR's OpenOneRec two-stage rollout (mxuax/verl-GR) through grctl's verl integration.

verl-GR's own agent loop (`OpenOneRecTwoStageAgentLoop.run`, verl_gr/recipes/openonerec/
two_stage_agent_loop.py) and its beam contract (`build_two_stage_sampling_params`,
`resolve_beam_search_config`, `resolve_two_stage_decode_config`, beam_config.py) run unchanged
from a snapshot of verl-GR (tests/support/peers.py; skipped without one, and without verl).
The agent loop's server manager is grctl's verl server actor (grctl/integrations/verl.py
`GrctlServer`, here without Ray: tests/e2e/test_verl.py drives it through verl's Ray manager),
generating through a real `grctl serve` of the tiny OpenOneRec model (tests/support/onerec.py)
with its SID catalog. The parts of verl's AgentLoopBase that verl-GR's run calls and verl 0.9.1
renamed (`apply_chat_template`, `process_vision_info`) are given on the instance: a text-only
chat template. Runs on verl 0.9.1 (installed) and on verl-GR's pin 0.7.1 put first on the
path: `pip download --no-deps verl==0.7.1`, unzip the wheel into DIR, `PYTHONPATH=DIR:.`.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
import transformers

from grctl.catalog.sids import catalog_lines, sid_catalog
from tests.support.checkpoints import load_hf
from tests.support.onerec import expand_vocab, spread_sid_rows, write_base
from tests.support.peers import peer_package

pytest.importorskip("verl.workers.rollout.replica")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # as test_verl.py

VERL_GR = "mxuax/verl-GR"
# modules verl's agent loop imports at module level that its test environment lacks
STUBS = ("PIL", "datasets", "pandas")
WIDTH, REASONING_TOKENS, ITEM_TOKENS = 4, 24, 4


@pytest.fixture(scope="module")
def verl_gr(tmp_path_factory):
    with peer_package(VERL_GR, "verl_gr", tmp_path_factory.mktemp("verl_gr"), STUBS) as commit:
        from verl_gr.recipes.openonerec import two_stage_agent_loop
        from verl_gr.workers.rollout import beam_config

        yield SimpleNamespace(loop=two_stage_agent_loop, beams=beam_config, commit=commit)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    work = tmp_path_factory.mktemp("onerec")
    expand_vocab(write_base(work / "base", seed=7), work / "expanded", 3, 8)
    return spread_sid_rows(work / "expanded", seed=8, first=259)


@pytest.fixture(scope="module")
def catalog(model, tmp_path_factory):
    vocab = transformers.AutoTokenizer.from_pretrained(model).get_vocab()
    table = [(1000 + i, [i % 8, (3 * i) % 8, (5 * i + 1) % 8]) for i in range(20)]
    path = tmp_path_factory.mktemp("catalog") / "catalog.jsonl"
    path.write_bytes(catalog_lines(sid_catalog(table, vocab)))
    return path


@pytest.fixture(scope="module")
def srv(start_server, model, catalog):
    flags = ("--model-path", str(model), "--catalog", str(catalog))
    return start_server(*flags, "--allow-weight-update")  # verl pauses and resumes it


def rollout_config(url: str, defaults: dict | None = None) -> SimpleNamespace:
    """The rollout config fields GrctlServer reads; defaults: rollout.custom.grctl's
    sampling_params, merged under every request's."""
    custom = {"grctl": {"urls": [url], "sampling_params": defaults or {}}}
    return SimpleNamespace(
        custom=custom, prompt_length=64, response_length=64, free_cache_engine=False
    )


def agent_loop(verl_gr, url: str, tokenizer, defaults: dict | None = None):
    """verl-GR's agent loop, its server manager grctl's verl server actor."""
    from grctl.integrations.verl_rollout import GrctlServer

    server = GrctlServer(url, rollout_config(url, defaults), 0, None)

    class Manager:  # verl's AsyncLLMServerManager.generate, one replica
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            return await server.generate(prompt_ids, sampling_params, request_id, **kw)

    loop = object.__new__(verl_gr.loop.OpenOneRecTwoStageAgentLoop)
    loop.server_manager, loop.response_length = Manager(), 64

    async def process_vision_info(messages):
        return {}

    async def apply_chat_template(messages, images=None, videos=None):
        return tokenizer.encode("".join(m["content"] for m in messages))

    loop.process_vision_info, loop.apply_chat_template = process_vision_info, apply_chat_template
    return loop, server


def two_stage_fields(verl_gr, return_all_beams: bool) -> dict:
    """The fields OpenOneRecAgentLoopWorker.generate_sequences adds for a two_stage rollout."""
    sp = {"enable_two_stage_rollout": True}
    sp.update(
        verl_gr.beams.build_two_stage_sampling_params(
            reasoning_max_tokens=REASONING_TOKENS,
            item_max_tokens=ITEM_TOKENS,
            beam_width=WIDTH,
            return_all_beams=return_all_beams,
        )
    )
    return sp


def worker_params(verl_gr, return_all_beams: bool) -> dict:
    """What OpenOneRecAgentLoopWorker.generate_sequences sends for a two_stage rollout: verl's
    params, then verl-GR's two-stage fields."""
    sp = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
    return {**sp, **two_stage_fields(verl_gr, return_all_beams)}


async def run_samples(loop, params: dict, rollouts: range, step: int):
    messages = [{"role": "user", "content": "user watched a, b<think>"}]
    return await asyncio.gather(
        *(
            loop.run(
                dict(params),
                raw_prompt=messages,
                trajectory_rollout_n=n,
                trajectory_sample_index=0,
                trajectory_step=step,
                trajectory_validate=False,
            )
            for n in rollouts
        )
    )


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    hf = load_hf(model)
    logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1)
    return [float(lp[i, t]) for i, t in enumerate(response)]


def test_each_beam_index_gets_its_beam_of_one_group(verl_gr, srv, model, catalog):
    """The params as verl-GR's worker sends them for its two_stage rollout."""
    tok = transformers.AutoTokenizer.from_pretrained(model)
    params = worker_params(verl_gr, return_all_beams=True)
    loop, _ = agent_loop(verl_gr, srv.url, tok)
    # verl-GR's own reading of what it sends (its vLLM server's): the contract grctl serves
    config = SimpleNamespace(custom={})
    beam = verl_gr.beams.resolve_beam_search_config(dict(params), config=config, request_id="x")
    decode = verl_gr.beams.resolve_two_stage_decode_config(
        dict(params), config=config, response_length=64
    )
    assert (beam.width, beam.max_tokens, beam.return_mode) == (WIDTH, ITEM_TOKENS, "all_beams")
    prefix = tok.encode(decode.item_generation.prefix_text)
    think = tok.convert_tokens_to_ids(decode.reasoning.stop[0])  # "</think>"
    step = 1
    outs = asyncio.run(run_samples(loop, params, range(2 * WIDTH), step=step))
    items = {tuple(json.loads(x)["token_ids"]) for x in catalog.read_text().splitlines()}
    prompt = tok.encode("user watched a, b<think>")
    for group in range(2):
        mine = outs[group * WIDTH : (group + 1) * WIDTH]
        ids = {o.extra_fields["_beam_group_id"] for o in mine}
        assert ids == {f"{step}:0:0:{group}"}  # the agent loop's group id: one group per reasoning
        assert [o.extra_fields["_beam_index"] for o in mine] == list(range(WIDTH))
        responses = [o.response_ids for o in mine]
        assert len({tuple(r) for r in responses}) == WIDTH  # distinct beams
        cut = len(responses[0]) - len(mine[0].extra_fields["generated_items"]) - len(prefix)
        reasoning = responses[0][:cut]
        assert 0 < len(reasoning) <= decode.reasoning.max_tokens
        assert reasoning[-1] == think or len(reasoning) == decode.reasoning.max_tokens
        for o, r in zip(mine, responses, strict=True):
            item = o.extra_fields["generated_items"]
            # computed once: every index continues the same sampled reasoning (a second
            # sampling at temperature 1 would give another)
            assert r == reasoning + prefix + item and tuple(item) in items
            assert len(item) <= beam.max_tokens
            lp = o.response_logprobs
            assert lp[cut : cut + len(prefix)] == [0.0] * len(prefix)  # verl-GR's forced 0.0
            want = hf_logprobs(model, prompt, reasoning)  # the behaviour: T = 1, no filter
            assert lp[:cut] == pytest.approx(want, abs=1e-4)
    first = {tuple(o.response_ids[:4]) for o in outs[:WIDTH]}
    second = {tuple(o.response_ids[:4]) for o in outs[WIDTH:]}
    assert first != second  # two groups, two reasonings


def test_best_only_serves_the_groups_best_beam(verl_gr, srv, model):
    tok = transformers.AutoTokenizer.from_pretrained(model)
    loop, _ = agent_loop(verl_gr, srv.url, tok)
    outs = asyncio.run(run_samples(loop, worker_params(verl_gr, False), range(WIDTH), step=2))
    assert len({tuple(o.response_ids) for o in outs}) == 1  # every index: the one best beam


def test_abort_clears_the_groups(verl_gr, srv, model):
    """A group computed, its beams not all served; verl's abort_all_requests (pause abort),
    then resume: the next call of that group id computes a new group."""
    tok = transformers.AutoTokenizer.from_pretrained(model)
    loop, server = agent_loop(verl_gr, srv.url, tok)
    params = worker_params(verl_gr, return_all_beams=True)

    async def sample_abort_resume_sample():  # one event loop: the server actor's client's
        (before,) = await run_samples(loop, params, range(1), step=3)
        await server.abort_all_requests()
        await server.resume_generation()
        (after,) = await run_samples(loop, params, range(1), step=3)
        return before, after

    before, after = asyncio.run(sample_abort_resume_sample())
    assert after.extra_fields["_beam_group_id"] == before.extra_fields["_beam_group_id"]
    assert after.response_ids != before.response_ids  # sampled again, not the cached group


REGISTRATION = """
import sys, types
import verl
import grctl.integrations.verl
from verl.workers.rollout import base
from verl.workers.rollout.replica import RolloutReplicaRegistry
sys.path.insert(0, sys.argv[1])
# verl-GR's vLLM server module needs vllm, absent here: its replica class stands in
fake = types.ModuleType("verl_gr.workers.rollout.two_stage_vllm_async")
fake.TwoStagevLLMReplica = type("TwoStagevLLMReplica", (), {})
sys.modules[fake.__name__] = fake
from verl_gr.workers.rollout.two_stage_registration import (
    register_two_stage_replica, register_two_stage_rollout_class)
register_two_stage_replica()  # what verl-GR's OpenOneRec recipe runs in its prepare step
register_two_stage_rollout_class()  # and its worker's init_model
replica = RolloutReplicaRegistry.get("two_stage")
print(replica.__name__, base._ROLLOUT_REGISTRY[("two_stage", "async")])
"""


@pytest.mark.parametrize("pinned", [True, False])
def test_the_recipes_two_stage_name_stays_grctls(verl_gr, tmp_path, pinned):
    """GRCTL_VERL_ROLLOUT_NAMES=two_stage: verl-GR's own registration of its vLLM replica and
    rollout under "two_stage" leaves grctl's in place (without it, verl-GR's win)."""
    import subprocess
    import sys

    from tests.support.cli import cli_env
    from tests.support.peers import extract

    extract(VERL_GR, "verl_gr", tmp_path)
    env = cli_env({"GRCTL_VERL_ROLLOUT_NAMES": "two_stage" if pinned else ""})
    done = subprocess.run(
        [sys.executable, "-c", REGISTRATION, str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    replica, adapter = done.stdout.split()[-2:]
    if pinned:
        assert (replica, adapter) == (
            "GrctlReplica",
            "grctl.integrations.verl_weights.GrctlServerAdapter",
        )
    else:
        assert replica == "TwoStagevLLMReplica" and adapter.startswith("verl_gr.")
