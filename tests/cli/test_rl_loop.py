"""The RL loop learns through a real server (its own process): stochastic beams under the
served catalog, the update on transformers' Qwen3 in this process from the replies' behaviour
logprobs (the catalog replay, the unordered set estimator, a KL to a frozen reference, clipped
ratios), each step's weights pushed from memory. The figure that is asserted is the policy's
exact expected reward, enumerated over the whole catalog, not the beams' mean."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from grctl.cli.rl.loop import check, rollout, run_loop
from grctl.cli.rl.task import make_task
from grctl.cli.rl.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS, GROUP, LR = 8, 4, 3e-4


@pytest.fixture(scope="module")
def task():
    return make_task()


@pytest.fixture(scope="module")
def srv(start_server, task, tmp_path_factory):
    catalog = task.write_catalog(tmp_path_factory.mktemp("rl") / "catalog.jsonl")
    return start_server(
        "--allow-weight-update", "--catalog", str(catalog), env={"OMP_WAIT_POLICY": "passive"}
    )


@pytest.fixture(scope="module")
def trained(srv, task):
    trainer = Trainer(task, lr=LR)
    out = io.StringIO()
    rows = run_loop(
        srv.url, task, steps=STEPS, group=GROUP, trainer=trainer, console=Console(file=out)
    )
    return trainer, rows, out.getvalue()


def test_the_exact_expected_reward_rises(trained):
    _, rows, printed = trained
    exact = [r.exact_reward for r in rows]
    assert exact[0] < 0.35, exact
    assert sum(exact[-2:]) / 2 > exact[0] + 0.2, exact
    assert f"{STEPS}/{STEPS} steps" in printed and "NDCG" in printed
    # the beams' plain mean is another figure (biased: beams are distinct items)
    assert [r.beam_reward for r in rows] != exact


def test_first_epoch_ratios_are_one_and_every_rollout_carries_its_label(trained, task):
    _, rows, _ = trained
    check(rows)  # raises on a wrong label or a ratio gap over the loop's tolerance
    assert [r.step for r in rows] == list(range(STEPS))
    for r in rows:
        assert r.stats.first_ratio_gap < 1e-5 and r.stats.max_token_gap < 1e-5
        assert len(r.stats.epochs) == 2
        for g in r.groups:
            items = [tuple(s.output_ids) for s in g.samples]
            assert len(items) == GROUP == len(set(items)) and set(items) <= task.items.keys()
            assert {s.weight_version for s in g.samples} == {f"step-{r.step}"}
            assert g.threshold is not None  # 512 items: the support is never drawn whole


def test_kl_to_the_frozen_reference(trained):
    """Step 0 serves the reference itself (KL 0 exactly); the policy then moves away from it,
    and the reference does not move with it."""
    trainer, rows, _ = trained
    assert rows[0].kl_ref == pytest.approx(0.0, abs=1e-9)
    assert rows[-1].kl_ref > rows[1].kl_ref > 0
    moved = [
        (a - b).abs().max().item()
        for a, b in zip(trainer.model.parameters(), trainer.reference.parameters(), strict=True)
    ]
    assert max(moved) > 0 and not any(p.requires_grad for p in trainer.reference.parameters())


def test_served_logprobs_equal_the_replay_on_the_pushed_weights(trained, srv, task):
    """After the loop the server holds step-STEPS: a fresh rollout's behaviour logprobs and
    sampling_logprob against the trainer's replay on its own transformers model."""
    from grctl.client.http import GRClient

    trainer, _, _ = trained
    with GRClient(srv.url) as gr:
        groups = rollout(gr, task, group=3, seed=1000)
    samples = [s for g in groups for s in g.samples]
    assert {s.weight_version for s in samples} == {f"step-{STEPS}"}
    with torch.no_grad():
        got = trainer.logprobs(samples)
    for i, s in enumerate(samples):
        assert got.output[i].tolist() == pytest.approx(s.logprobs, abs=1e-5)
        assert got.sequence()[i].item() == pytest.approx(s.sampling_logprob, abs=1e-5)
