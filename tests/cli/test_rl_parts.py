"""The RL loop's parts in this process, no server: the task's catalog and reward, and the
trainer's log-probabilities and step against direct computations on transformers' Qwen3."""

from __future__ import annotations

import pytest
import torch

from grctl.cli.rl.task import make_task
from grctl.cli.rl.trainer import Sample, Trainer
from grctl.model.builtin import NUM_TEXT_TOKENS, SID_CODES


@pytest.fixture(scope="module")
def task():
    return make_task(num_users=3, num_items=64, num_preferred=2, seed=3)


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


def samples_of(task, paths):
    return [Sample(0, task.prompt(0), list(p), [0.0] * 3, "x", 0.0) for p in paths]


def test_logprobs_against_a_direct_forward(task):
    """raw: log_softmax of transformers' logits; masked: renormalised over the catalog's
    children, so the masked probabilities of all children of a prefix sum to one."""
    trainer = Trainer(task)
    paths = list(task.items)[:5]
    raw, masked, valid = trainer.logprobs(samples_of(task, paths))
    assert valid.all()
    for i, p in enumerate(paths):
        ids = torch.tensor([task.prompt(0) + list(p)])
        with torch.no_grad():
            lps = torch.log_softmax(trainer.model(input_ids=ids).logits[0], dim=-1)
        assert raw[i].tolist() == pytest.approx(
            [lps[1 + t, p[t]].item() for t in range(3)], abs=1e-5
        )
    prefix = paths[0][:2]
    siblings = [(*prefix, c) for c in task.children[prefix]]
    _, masked, _ = trainer.logprobs(samples_of(task, siblings))
    assert masked[:, 2].exp().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_a_step_moves_probability_to_the_better_sample(task):
    trainer = Trainer(task, lr=1e-3)
    good, bad = list(task.items)[:2]
    samples = samples_of(task, [good, bad])
    samples[0].reward, samples[1].reward = 1.0, 0.0
    with torch.no_grad():
        _, before, _ = trainer.logprobs(samples)
    _, masked, _ = trainer.logprobs(samples)
    for s, lps in zip(samples, masked.tolist(), strict=True):
        s.logprobs = lps  # as if grctl had served these weights (its behaviour logprobs)
    stats = trainer.step(samples, [0, 0])
    with torch.no_grad():
        _, after, _ = trainer.logprobs(samples)
    gain = (after - before).sum(-1)
    assert gain[0] > 0 > gain[1]
    assert stats.max_abs_log_ratio < 1e-6 and stats.kl > 0
