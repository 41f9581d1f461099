"""Two-stage estimators against exact enumeration on a toy: reasonings of two tokens over three
(9 of them) sampled i.i.d., then for each k = 3 items of a 6-item two-level catalog drawn
without replacement (the test's own Gumbel top-k), a reward depending on both. The exact E[r]
and its gradient come from summing over every reasoning and item with autograd; the
estimates of many seeded rollouts must agree within 3 standard errors (the gradient: along
the exact gradient and random directions), while the group mean over beams (GRPO over beams)
is off by many.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from grctl.rl.group_relative import group_relative_advantages, sibling_relative_advantages
from grctl.rl.two_stage import two_stage_estimate

ITEMS = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]
REASONINGS = list(itertools.product(range(3), repeat=2))
N, K = 3, 3


class Toy:
    """A tabular two-stage policy: pi(z) token by token, q(y | z) down the catalog's trie."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.theta = [
            torch.randn(3, generator=gen, dtype=torch.float64).requires_grad_(),
            torch.randn(3, 3, generator=gen, dtype=torch.float64).requires_grad_(),
            torch.randn(9, 3, generator=gen, dtype=torch.float64).requires_grad_(),
            torch.randn(9, 3, 3, generator=gen, dtype=torch.float64).requires_grad_(),
        ]
        # the reward needs both stages: an item pays when its first code matches the reasoning's
        # last token, plus noise-free per-pair terms
        self.reward = torch.rand(9, 6, generator=gen, dtype=torch.float64) * 0.3
        for zi, z in enumerate(REASONINGS):
            for yi, y in enumerate(ITEMS):
                self.reward[zi, yi] += float(y[0] == z[1])

    def log_pi(self) -> torch.Tensor:  # [9]
        t1, t2 = self.theta[0].log_softmax(0), self.theta[1].log_softmax(1)
        return torch.stack([t1[a] + t2[a, b] for a, b in REASONINGS])

    def log_q(self) -> torch.Tensor:  # [9, 6]
        mask = torch.full((3, 3), -math.inf, dtype=torch.float64)
        for a, b in ITEMS:
            mask[a, b] = 0.0
        p1 = self.theta[2].log_softmax(1)
        p2 = (self.theta[3] + mask).log_softmax(2)
        return torch.stack([p1[:, a] + p2[:, a, b] for a, b in ITEMS], 1)

    def exact(self) -> tuple[float, torch.Tensor]:
        j = (self.log_pi().exp()[:, None] * self.log_q().exp() * self.reward).sum()
        grads = torch.autograd.grad(j, self.theta)
        return j.item(), torch.cat([g.reshape(-1) for g in grads])

    def score_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """grad log pi(z) [9, P] and grad log q(y | z) [9, 6, P]."""
        lp, lq = self.log_pi(), self.log_q()

        def flat(out: torch.Tensor) -> torch.Tensor:
            grads = torch.autograd.grad(out, self.theta, retain_graph=True, allow_unused=True)
            return torch.cat(
                [(torch.zeros_like(t) if g is None else g).reshape(-1)
                 for g, t in zip(grads, self.theta, strict=True)]
            )  # fmt: skip

        gp = torch.stack([flat(lp[z]) for z in range(9)])
        gq = torch.stack([torch.stack([flat(lq[z, y]) for y in range(6)]) for z in range(9)])
        return gp, gq


def rollouts(toy: Toy, num: int, seed: int):
    """num rollouts of one prompt: N reasonings i.i.d., K items each without replacement."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lp, lq = toy.log_pi(), toy.log_q()
    for _ in range(num):
        zs = torch.multinomial(lp.exp(), N, replacement=True, generator=gen).tolist()
        beams = []
        for z in zs:
            u = torch.rand(6, generator=gen, dtype=torch.float64)
            keys = lq[z] - torch.log(-torch.log(u))  # Gumbel(log q)
            beams.append(torch.topk(keys, K).indices.tolist())
        yield zs, beams, lq


def check_within(samples: torch.Tensor, exact: torch.Tensor, bound: float) -> torch.Tensor:
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(samples.shape[0])
    z = (mean - exact) / se.clamp(min=1e-12)
    assert z.abs().max() < bound, (z, mean, exact)
    return z


@pytest.mark.slow
def test_two_stage_value_and_gradient_are_unbiased():
    toy = Toy()
    exact_j, exact_g = toy.exact()
    gp, gq = toy.score_vectors()
    values, grads, group_means = [], [], []
    for zs, beams, lq in rollouts(toy, 3000, seed=1):
        est = two_stage_estimate(
            [lq[z, b].tolist() for z, b in zip(zs, beams, strict=True)],
            [toy.reward[z, b].tolist() for z, b in zip(zs, beams, strict=True)],
        )
        values.append(est.value)
        g = sum(a * gp[z] for a, z in zip(est.reasoning.tolist(), zs, strict=True))
        for z, b, c in zip(zs, beams, est.items, strict=True):
            g = g + (c[:, None] * gq[z, b]).sum(0)
        grads.append(g)
        group_means.append(sum(toy.reward[z, b].mean() for z, b in zip(zs, beams, strict=True)) / N)
    check_within(torch.tensor(values)[:, None], torch.tensor([exact_j]), 3.0)
    # the gradient along the exact one and 8 random directions (single coordinates of rare
    # reasonings are too heavy-tailed for their standard error to be read): 9 z-tests
    dirs = torch.cat(
        (exact_g[None], torch.randn(8, exact_g.numel(), generator=torch.Generator().manual_seed(0),
                                    dtype=torch.float64))
    )  # fmt: skip
    check_within(torch.stack(grads) @ dirs.T, dirs @ exact_g, 3.5)
    z_mean = (torch.tensor(group_means).mean() - exact_j) / (
        torch.tensor(group_means).std() / math.sqrt(len(group_means))
    )
    assert abs(z_mean) > 10  # the group mean over beams estimates something else


def test_two_stage_value_is_unbiased_quick():
    """The default suite's version: the value only, fewer rollouts."""
    toy = Toy(seed=3)
    exact_j, _ = toy.exact()
    values = []
    for zs, beams, lq in rollouts(toy, 400, seed=2):
        est = two_stage_estimate(
            [lq[z, b].tolist() for z, b in zip(zs, beams, strict=True)],
            [toy.reward[z, b].tolist() for z, b in zip(zs, beams, strict=True)],
        )
        values.append(est.value)
    check_within(torch.tensor(values)[:, None], torch.tensor([exact_j]), 3.0)


def test_whole_support_gives_each_reasonings_exact_value_and_leave_one_out():
    toy = Toy(seed=5)
    with torch.no_grad():
        lq = toy.log_q()
    zs = [0, 4, 8]
    est = two_stage_estimate(
        [lq[z].tolist() for z in zs],
        [toy.reward[z].tolist() for z in zs],
        whole_support=True,
    )
    exact_v = (lq.exp() * toy.reward).sum(1)[zs]
    assert est.values.tolist() == pytest.approx(exact_v.tolist(), abs=1e-12)
    loo = torch.stack([exact_v[[j for j in range(3) if j != i]].mean() for i in range(3)])
    assert est.reasoning.tolist() == pytest.approx(((exact_v - loo) / 3).tolist(), abs=1e-12)
    # the whole support's built-in baseline is the exact V: c_s = q(s) (r(s) - V) / n
    want = lq[4].exp() * (toy.reward[4] - exact_v[1]) / 3
    assert est.items[1].tolist() == pytest.approx(want.tolist(), abs=1e-12)
    one = two_stage_estimate([lq[0].tolist()], [toy.reward[0].tolist()], whole_support=True)
    assert one.reasoning.tolist() == pytest.approx([exact_v[0].item()])  # n = 1: no baseline


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (([], []), "one list"),
        (([[0.0]], [[1.0], [2.0]]), "one list"),
        (([[-1.0, -2.0]], [[1.0]]), "one reward per beam"),
    ],
)
def test_two_stage_refuses_mismatched_inputs(args, needle):
    with pytest.raises(ValueError, match=needle):
        two_stage_estimate(*args)


def test_group_relative_is_grpos_normalised_reward():
    r = [1.0, 0.0, 0.5, 0.5]
    got = group_relative_advantages(r)
    t = torch.tensor(r, dtype=torch.float64)
    assert got.tolist() == pytest.approx(((t - t.mean()) / (t.std() + 1e-6)).tolist())
    assert group_relative_advantages(r, scale=False).tolist() == pytest.approx([0.5, -0.5, 0, 0])
    assert group_relative_advantages([3.0]).tolist() == [0.0]


def test_sibling_relative_compares_children_of_one_prefix():
    # beams: (5, 1), (5, 2), (6, 1), (6, 1, 9)... a tree: root -> 5 {1, 2}, 6 {1}
    ids = [[5, 1], [5, 2], [6, 1]]
    r = [1.0, 0.0, 0.4]
    adv = sibling_relative_advantages(ids, r, scale=False)
    # root: children 5 (value 0.5) and 6 (0.4), mean 0.45; node 5: children 1 (1.0), 2 (0.0)
    assert adv[0].tolist() == pytest.approx([0.05, 0.5])
    assert adv[1].tolist() == pytest.approx([0.05, -0.5])
    assert adv[2].tolist() == pytest.approx([-0.05, 0.0])  # 6 has one child taken: no decision
    scaled = sibling_relative_advantages(ids, r)
    std_root = torch.tensor([0.5, 0.4]).std().item()
    assert scaled[2][0].item() == pytest.approx(-0.05 / (std_root + 1e-6))
    with pytest.raises(ValueError, match="one reward per beam"):
        sibling_relative_advantages(ids, r[:2])
