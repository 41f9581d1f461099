"""The RL loop's parts in this process, no server: the task's catalog and reward, the trainer's
replayed logprobs and exact evaluation against direct computations on transformers' Qwen3,
the slate metrics by hand, and one step's estimator, ratios and KL."""

from __future__ import annotations

import math

import pytest
import torch

from grctl.cli.rl.task import make_task
from grctl.cli.rl.trainer import Group, Sample, Trainer, slate_metrics
from grctl.model.builtin import NUM_TEXT_TOKENS, SID_CODES


@pytest.fixture(scope="module")
def task():
    return make_task(num_users=3, num_items=64, num_preferred=2, seed=3)


@pytest.fixture(scope="module")
def trainer(task):
    return Trainer(task)


def test_catalog_and_reward(task):
    assert len(task.items) == 64 and len(set(task.items.values())) == 64
    for path in task.items:
        for level, token in enumerate(path):
            assert (
                NUM_TEXT_TOKENS + SID_CODES * level
                <= token
                < NUM_TEXT_TOKENS + SID_CODES * (level + 1)
            )
            assert token in task.children[path[:level]]
    for user, favourites in enumerate(task.preferred):
        assert favourites <= task.items.keys()
        assert all(task.reward(user, p) == 1.0 for p in favourites)
        first = next(iter(favourites))
        others = [p for p in task.items if p not in favourites and p[0] == first[0]]
        assert all(task.reward(user, p) >= 1 / 3 for p in others)
    assert make_task(num_users=3, num_items=64, num_preferred=2, seed=3) == task


def samples_of(task, paths, user=0):
    return [Sample(user, task.prompt(user), list(p), [0.0] * 3, 0.0, "x", 0.0) for p in paths]


def direct(trainer, task, user, path):
    """log pi(path | user): transformers' logits, renormalised by hand over the catalog's
    children of each prefix."""
    ids = torch.tensor([task.prompt(user) + list(path)])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0].double()
    total = 0.0
    for t, token in enumerate(path):
        kids = list(task.children[tuple(path[:t])])
        row = logits[len(task.prompt(user)) - 1 + t]
        total += float(row[token] - torch.logsumexp(row[kids], 0))
    return total


def test_replayed_logprobs_and_the_enumeration_against_a_direct_forward(trainer, task):
    paths = list(task.items)
    with torch.no_grad():
        got = trainer.logprobs(samples_of(task, paths[:6], user=1)).sequence()
    assert got.tolist() == pytest.approx([direct(trainer, task, 1, p) for p in paths[:6]], abs=1e-5)
    table = trainer.item_logprobs(trainer.model)  # one forward per distinct prefix
    assert table.shape == (task.num_users, len(paths))
    assert table[1, :6].tolist() == pytest.approx(got.tolist(), abs=1e-6)
    assert table.exp().sum(-1).tolist() == pytest.approx([1.0] * task.num_users, abs=1e-5)
    rewards, kls = trainer.exact()
    for user in range(task.num_users):
        r = torch.tensor([task.reward(user, p) for p in paths], dtype=torch.float64)
        assert rewards[user] == pytest.approx(float((table[user].exp() * r).sum()), abs=1e-9)
    assert kls == pytest.approx([0.0] * task.num_users, abs=1e-9)  # pi is still pi_ref


def test_slate_metrics_by_hand():
    rel = frozenset({"a", "b", "c"})
    recall, ndcg = slate_metrics(["x", "a", "y", "b"], rel, k=4)
    assert recall == pytest.approx(2 / 3)
    ideal = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    assert ndcg == pytest.approx((1 / math.log2(3) + 1 / math.log2(5)) / ideal)
    assert slate_metrics(["a", "b", "c"], rel, k=3) == pytest.approx((1.0, 1.0))
    assert slate_metrics(["x", "a"], rel, k=1) == (0.0, 0.0)


def served(trainer, samples):
    """Give samples the logprobs grctl would report on the trainer's weights (the replay)."""
    with torch.no_grad():
        got = trainer.logprobs(samples)
    for s, lps in zip(samples, got.output.tolist(), strict=True):
        s.logprobs = lps
        s.sampling_logprob = sum(lps)
    return samples


@pytest.mark.parametrize("estimator", ["unordered_set", "priority"])
def test_a_step_moves_probability_to_the_better_beam(task, estimator):
    trainer = Trainer(task, lr=1e-3, estimator=estimator, epochs=3)
    good, bad, other = list(task.items)[:3]
    samples = served(trainer, samples_of(task, [good, bad, other]))
    for s, r in zip(samples, (1.0, 0.0, 0.0), strict=True):
        s.reward = r
    with torch.no_grad():
        before = trainer.logprobs(samples).sequence()
    threshold = min(s.sampling_logprob for s in samples) - 1.0  # a key below the beams'
    stats = trainer.step([Group(0, samples, threshold)])
    with torch.no_grad():
        after = trainer.logprobs(samples).sequence()
    gain = after - before
    assert gain[0] > 0 > gain[1] and gain[0] > 0 > gain[2]
    assert stats.first_ratio_gap < 1e-5 and stats.max_token_gap < 1e-5
    assert len(stats.epochs) == 3 and stats.epochs[0]["ratio_max"] == pytest.approx(1, abs=1e-5)
    assert stats.ratio_max > 1  # later epochs see the updated policy, clipped at 1 + eps
    assert 0 < stats.estimate < (1 if estimator == "unordered_set" else 3)


def test_the_first_epoch_ratio_shows_logprobs_of_another_distribution(task):
    """Logprobs before the catalog mask (what grctl reported before issue 25) are not the
    behaviour policy's: the first epoch's ratio is far from 1 and the loop would stop."""
    trainer = Trainer(task)
    samples = samples_of(task, list(task.items)[:2])
    ids = torch.tensor([s.prompt + s.output_ids for s in samples])
    with torch.no_grad():
        lps = torch.log_softmax(trainer.model(input_ids=ids).logits, -1)
    for i, s in enumerate(samples):
        s.logprobs = [lps[i, 1 + t, tok].item() for t, tok in enumerate(s.output_ids)]
        s.sampling_logprob = sum(s.logprobs)
    stats = trainer.step([Group(0, samples, None, whole_support=False)])
    assert stats.first_ratio_gap > 1.0 and stats.max_token_gap > 0.5


def test_summary_compares_disjoint_windows():
    from grctl.cli.rl.loop import StepRow, summary
    from grctl.cli.rl.trainer import StepStats

    stats = StepStats(0.0, 0.5, 0.0, 1e-6, 2e-6, 0.9, 1.1, 0.0)
    rows = [
        StepRow(i, f"step-{i}", i / 10, 0.0, 0.2, 0.1, 0.1, stats, 0, 0, 0, 0) for i in range(4)
    ]
    s = summary(rows)
    assert s["window"] == 2 and s["exact_reward_first"] == pytest.approx(0.05)
    assert s["exact_reward_last"] == pytest.approx(0.25) and s["max_first_ratio_gap"] == 2e-6
    assert summary(rows * 5)["window"] == 5
