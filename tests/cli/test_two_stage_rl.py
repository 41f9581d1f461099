"""`grctl demo --rl --two-stage` and examples/two_stage_rl_loop.py: a policy that reasons, then
recommends, learning through a real server.

Fast (no server): the toy's enumeration against transformers' logits taken one sequence at a
time, normalised over every reasoning and item, and the trainer's replay of both stages equal
to it. Slow: the served policy's behaviour logprobs equal the enumeration; the example, a
client process of its own against a real `grctl serve`, raises the exact expected reward
(enumerated, not sampled) well beyond what one step's noise moves it; and the CLI's --json run
of the demo (its own server and client) reports the same kind of document.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from grctl.cli.rl.two_stage_loop import Beam, Reasoning, TwoStageTrainer
from grctl.cli.rl.two_stage_task import (
    PREFIX,
    REASONING_LEN,
    VOCAB,
    TwoStageTask,
    all_logprobs,
    exact,
    joint_logprobs,
    reasonings,
    toy_model,
)
from tests.support.cli import cli_env, grctl
from tests.support.serverproc import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "two_stage_rl_loop.py"


@pytest.fixture(scope="module")
def task():
    return TwoStageTask()


@pytest.fixture(scope="module")
def model():
    return toy_model()


def direct(model, task, user, z, item) -> tuple[float, float]:
    """(log pi(z), log q(item | z)) from one forward of this one sequence, by hand."""
    prompt = task.prompt(user)
    ids = torch.tensor([prompt + list(z) + list(PREFIX) + list(item)])
    with torch.no_grad():
        lp = model(input_ids=ids).logits[0].double().log_softmax(-1)
    p = len(prompt)
    lz = sum(float(lp[p - 1 + t, z[t]]) for t in range(len(z)))
    firsts = sorted({a for a, _ in task.items})
    kids = [b for a, b in task.items if a == item[0]]
    row1 = lp[p + len(z) + len(PREFIX) - 1]
    row2 = lp[p + len(z) + len(PREFIX)]
    lq = float(row1[item[0]] - row1[firsts].logsumexp(0))
    lq += float(row2[item[1]] - row2[kids].logsumexp(0))
    return lz, lq


def test_the_enumeration_is_transformers_one_sequence_at_a_time(task, model):
    zs = reasonings()
    assert len(zs) == VOCAB**REASONING_LEN == len(set(zs))
    lz, lq = joint_logprobs(model, task, 1)
    assert float(lz.exp().sum()) == pytest.approx(1.0, abs=1e-9)
    assert lq.exp().sum(-1).tolist() == pytest.approx([1.0] * len(zs), abs=1e-9)
    gen = torch.Generator().manual_seed(0)
    for zi in torch.randint(0, len(zs), (6,), generator=gen).tolist():
        for yi in (0, 5, len(task.items) - 1):
            want = direct(model, task, 1, zs[zi], task.items[yi])
            assert (lz[zi].item(), lq[zi, yi].item()) == pytest.approx(want, abs=1e-5)


def test_exact_reward_and_kl_by_hand(task, model):
    pol = [joint_logprobs(model, task, 0)]
    values, kls = exact(pol, pol, task)
    assert kls == pytest.approx([0.0], abs=1e-12)
    lz, lq = pol[0][0].tolist(), pol[0][1].tolist()
    want = sum(
        math.exp(lz[i] + lq[i][j]) * (y[0] in z)
        for i, z in enumerate(reasonings())
        for j, y in enumerate(task.items)
    )
    assert values[0] == pytest.approx(want, rel=1e-9)
    assert 0.02 < values[0] < 0.15  # a policy that knows nothing rarely names the item's code


def test_the_trainers_replay_of_both_stages_equals_the_enumeration(task, model):
    trainer = TwoStageTrainer(task, model=model)
    lz, lq = joint_logprobs(model, task, 0)
    zs = reasonings()
    groups = []
    for zi in (3, 77, 1000):
        beams = [Beam(task.items[j], [0.0, 0.0], 0.0, 0.0) for j in (0, 9, 15)]
        groups.append(Reasoning(0, list(zs[zi]), [0.0] * REASONING_LEN, beams, False, "x"))
    with torch.no_grad():
        got_z, got_y = trainer.logprobs(groups)
    for zi, rz, ry in zip((3, 77, 1000), got_z, got_y, strict=True):
        assert rz.sum().item() == pytest.approx(lz[zi].item(), abs=1e-5)
        assert ry.sum(-1).tolist() == pytest.approx(lq[zi, [0, 9, 15]].tolist(), abs=1e-5)


def test_two_stage_needs_rl():
    out = grctl("demo", "--two-stage")
    assert out.returncode == 2 and "--two-stage needs --rl" in out.stdout + out.stderr


@pytest.fixture(scope="module")
def toy_server(start_server, task, tmp_path_factory):
    root = tmp_path_factory.mktemp("two-stage-rl")
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--write-model", str(root / "model"),
         "--write-catalog", str(root / "catalog.jsonl")],
        capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return start_server(
        "--allow-weight-update",
        "--model-path",
        str(root / "model"),
        "--catalog",
        str(root / "catalog.jsonl"),
        env={"OMP_WAIT_POLICY": "passive"},
    )


@pytest.mark.slow
def test_served_behaviour_logprobs_are_the_enumerated_policy(toy_server, task, model):
    """The toy's initial weights pushed from memory as the loop pushes them: every reasoning's
    and every item's behaviour logprob is the enumeration's, so the exact E[r] is the served
    policy's."""
    from grctl.cli.rl.two_stage_loop import rollout
    from grctl.client.http import GRClient
    from grctl.client.sync import WeightSync

    with WeightSync(toy_server.url) as sync:
        sync.run(model.state_dict(), weight_version="initial")
    with GRClient(toy_server.url) as gr:
        groups = rollout(gr, task, reasoning_n=3, beams=4, seed=5)
    assert {g.weight_version for g in groups} == {"initial"}
    assert len(groups) == 3 * task.num_users
    zs = reasonings()
    tables = all_logprobs(model, task)
    for g in groups:
        lz, lq = tables[g.user]
        zi = zs.index(tuple(g.reasoning))
        assert sum(g.reasoning_logprobs) == pytest.approx(lz[zi].item(), abs=1e-5)
        assert len({b.item for b in g.beams}) == 4 and not g.whole_support
        for b in g.beams:
            yi = task.items.index(b.item)
            assert b.sampling_logprob == pytest.approx(lq[zi, yi].item(), abs=1e-5)
            assert b.reward == float(b.item[0] in g.reasoning)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_raises_the_exact_expected_reward(toy_server):
    """The example in its own process against the real server: 12 steps. The figure asserted is
    the enumerated E[r] of the served policy at each step, so the rise is no sampling noise;
    a step moves it by a few hundredths, the run must add 0.25."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", toy_server.url, "--steps", "12", "--json"],
        capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT, timeout=540,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    steps = doc["steps"]
    exact_r = [s["exact_reward"] for s in steps]
    assert [s["step"] for s in steps] == list(range(12))
    assert [s["weight_version"] for s in steps] == [f"step-{k}" for k in range(12)]
    assert exact_r[0] < 0.15 and exact_r[-1] > exact_r[0] + 0.25, exact_r
    assert all(s["max_token_gap"] < 1e-5 for s in steps)
    assert steps[0]["kl_ref"] == pytest.approx(0.0, abs=1e-9) and steps[-1]["kl_ref"] > 0.1
    assert doc["summary"]["exact_reward_last"] == exact_r[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_json():
    out = grctl("demo", "--rl", "--two-stage", "--steps", "3", "--json", timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)  # the tables went to stderr
    assert doc["command"] == "demo" and doc["ok"] is True and doc["mode"] == "rl-two-stage"
    assert [s["weight_version"] for s in doc["steps"]] == ["step-0", "step-1", "step-2"]
    assert "E[r]" in out.stderr and "exact E[r]" in out.stderr
    first = doc["steps"][0]
    assert 0.02 < first["exact_reward"] < 0.15 and first["kl_ref"] == pytest.approx(0, abs=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_other_demos_json(tmp_path):
    """--json on the weight-sync demo and the one-stage loop: one document on stdout each, the
    weight-sync demo's restored output equal to the built-in model's first one."""
    out = grctl("demo", "--json", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["command"] == "demo" and doc["ok"] and doc["mode"] == "weight-sync"
    versions = [s["weight_version"] for s in doc["steps"]]
    assert versions == ["builtin", "perturbed", "restored"]
    assert doc["steps"][2]["output_ids"] == doc["steps"][0]["output_ids"]
    assert doc["summary"]["total_s"] > 0
    plot = str(tmp_path / "curve.png")
    out = grctl(
        "demo", "--rl", "--steps", "2", "--group", "2", "--json", "--plot", plot, timeout=280
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["mode"] == "rl" and [s["weight_version"] for s in doc["steps"]] == [
        "step-0",
        "step-1",
    ]
    assert doc["steps"][0]["kl_ref"] == pytest.approx(0.0, abs=1e-9)
    assert doc["summary"]["max_first_ratio_gap"] < 1e-4
