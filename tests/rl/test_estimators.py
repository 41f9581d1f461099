"""The estimators for beams sampled without replacement, against exact enumeration: the set
probability against the sum over its orderings, the unordered set estimator's (and its
baselined gradient's) expectation over every ordered sample of a small domain, and, on a tiny
sequence policy over a small catalog, many seeded samples of the test's own Gumbel top-k
sampler: the weighted estimates of E[r] agree with the exact value within 3 standard errors,
the plain beam mean does not."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from grctl.rl.estimators import (
    inclusion_logprob,
    priority_weights,
    set_logprob,
    unordered_set_advantages,
    unordered_set_baselines,
    unordered_set_weights,
)


def ordered_prob(p: list[float], seq: tuple[int, ...]) -> float:
    """Probability of drawing seq in this order, without replacement."""
    out, left = 1.0, 1.0
    for i in seq:
        out *= p[i] / left
        left -= p[i]
    return out


def set_prob(p, s) -> float:
    return sum(ordered_prob(p, perm) for perm in itertools.permutations(s))


DOMAINS = {
    "flat": [1 / 7] * 7,
    "peaked": [0.9, 0.05, 0.03, 0.01, 0.008, 0.0019, 0.0001],
    "tiny": [0.999, 1e-4, 2e-4, 3e-4, 1e-6, 4e-4, 0.0000990],
}


@pytest.mark.parametrize("name", DOMAINS)
def test_set_probability_is_the_sum_over_orderings(name):
    p = [x / sum(DOMAINS[name]) for x in DOMAINS[name]]
    for k in (1, 2, 3, 5, 6):
        for s in [tuple(range(k)), tuple(range(7 - k, 7)), tuple(range(0, 7, 2))[:k]]:
            got = set_logprob(torch.tensor([math.log(p[i]) for i in s], dtype=torch.float64))
            got = got.exp().item()
            assert got == pytest.approx(set_prob(p, s), rel=1e-8), (k, s)
    whole = torch.tensor([math.log(x) for x in p], dtype=torch.float64)
    assert set_logprob(whole).item() == pytest.approx(0.0, abs=1e-9)


def test_inclusion_probability_is_the_gumbel_tail():
    phi = torch.tensor([-3.0, -1.0, 0.0, 2.0])
    for kappa in (-2.0, 0.5):
        want = [1 - math.exp(-math.exp(x - kappa)) for x in phi.tolist()]
        assert inclusion_logprob(phi, kappa).exp().tolist() == pytest.approx(want, rel=1e-12)
    far = inclusion_logprob(torch.tensor([-60.0, 40.0]), 0.0)  # no underflow, no log(0)
    assert far.tolist() == pytest.approx([-60.0, 0.0], abs=1e-12)
    assert inclusion_logprob(phi, None).tolist() == [0.0] * 4


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_unordered_set_estimates_are_exact_in_expectation(k, seed):
    """Over every ordered sample of k of 6 (its probability as weight): E[sum_s w_s f(s)] =
    E_p[f], E[B_s] is free of s's choice, and the baselined gradient's expectation is
    grad E_p[f] (the policy a softmax of theta, by autograd)."""
    gen = torch.Generator().manual_seed(seed)
    theta = (2.0 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_(True)
    f = torch.rand(6, generator=gen, dtype=torch.float64)
    logp = torch.log_softmax(theta, 0)
    p = logp.exp().tolist()
    estimate, surrogate = 0.0, 0.0
    for seq in itertools.permutations(range(6), k):
        prob = ordered_prob(p, seq)
        idx = list(seq)
        lq = logp.detach()[idx]
        w = unordered_set_weights(lq)
        assert float(w.sum()) == pytest.approx(1.0, abs=1e-9)  # P(S) = sum_s q(s) P(S\s)
        estimate += prob * float((w * f[idx]).sum())
        c = unordered_set_advantages(lq, f[idx])
        surrogate = surrogate + prob * (c * logp[idx]).sum()
    exact = float((logp.exp() * f).sum().detach())
    assert estimate == pytest.approx(exact, abs=1e-9)
    (grad,) = torch.autograd.grad(surrogate, theta, retain_graph=True)
    (want,) = torch.autograd.grad((logp.exp() * f).sum(), theta)
    assert torch.allclose(grad, want, atol=1e-9), (grad, want)


def test_whole_support_weights_are_the_probabilities():
    lq = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    f = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    assert unordered_set_weights(lq).tolist() == pytest.approx([0.5, 0.3, 0.2], abs=1e-9)
    assert unordered_set_baselines(lq, f).tolist() == pytest.approx([0.9] * 3, abs=1e-9)
    assert priority_weights(lq, None).tolist() == pytest.approx([0.5, 0.3, 0.2])


class ToyPolicy:
    """A two-level sequence policy over a small catalog (first token, then a child), each level
    a fixed softmax: every item's probability and reward enumerable."""

    def __init__(self, seed: int = 0, firsts: int = 5, children: int = 6):
        gen = torch.Generator().manual_seed(seed)
        first = torch.log_softmax(3.0 * torch.randn(firsts, generator=gen, dtype=torch.float64), 0)
        second = torch.log_softmax(
            3.0 * torch.randn(firsts, children, generator=gen, dtype=torch.float64), 1
        )
        self.logp = (first[:, None] + second).flatten()  # [items]
        # the likely items pay: a beam mean over distinct items is dragged down by the rest
        order = self.logp.argsort(descending=True)
        self.reward = torch.zeros_like(self.logp)
        self.reward[order[:3]] = 1.0
        self.reward[order[3:8]] = 0.5
        self.exact = float((self.logp.exp() * self.reward).sum())

    def sample(self, k: int, gen: torch.Generator):
        """The test's own Gumbel top-k: perturb every item's log-probability, keep the k
        largest keys; the (k+1)-th is the threshold."""
        u = torch.rand(self.logp.shape, generator=gen, dtype=torch.float64)
        keys = self.logp - torch.log(-torch.log(u))
        top, idx = keys.topk(k + 1)
        return idx[:k], float(top[k])


def test_weighted_estimates_of_the_expected_reward_are_unbiased_and_the_beam_mean_is_not():
    policy, k, draws = ToyPolicy(seed=4), 4, 3000
    gen = torch.Generator().manual_seed(123)
    plain, prio, prio_norm, us = [], [], [], []
    for _ in range(draws):
        idx, kappa = policy.sample(k, gen)
        lq, r = policy.logp[idx], policy.reward[idx]
        plain.append(float(r.mean()))
        prio.append(float((priority_weights(lq, kappa) * r).sum()))
        prio_norm.append(float((priority_weights(lq, kappa, normalize=True) * r).sum()))
        us.append(float((unordered_set_weights(lq) * r).sum()))

    def mean_se(xs):
        t = torch.tensor(xs, dtype=torch.float64)
        return float(t.mean()), float(t.std() / math.sqrt(len(xs)))

    figures = {n: mean_se(x) for n, x in (("plain", plain), ("priority", prio), ("us", us))}
    print({"exact": policy.exact, **figures, "priority_normalized": mean_se(prio_norm)})
    for name in ("priority", "us"):
        mean, se = figures[name]
        assert abs(mean - policy.exact) < 3 * se, (name, mean, se, policy.exact)
    mean, se = figures["plain"]
    assert abs(mean - policy.exact) > 20 * se and abs(mean - policy.exact) > 0.1, figures


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_tempered_beams_corrected_to_the_t1_policy(temperature):
    """Beams drawn at T != 1 are a sample without replacement of the tempered policy q_T, so
    the weights estimate E_{q_T}[r]; multiplied by rho = pi_1 / q_T (the T = 1 policy replayed
    over the same support) they estimate E_{pi_1}[r], and sum_s w_s rho_s (r_s - b) grad log
    pi_1(s) its gradient, for any constant b (docs/rl-integration.md). Exact: the expectation
    over every ordered sample of k = 3 of 6 items."""
    theta = torch.tensor([1.2, 0.3, -0.4, 0.9, -1.1, 0.0], dtype=torch.float64)
    r = torch.tensor([1.0, 0.2, 0.0, 0.7, 0.4, 0.1], dtype=torch.float64)
    log_pi = theta.log_softmax(0)
    log_q = (theta / temperature).log_softmax(0)
    q = log_q.exp().tolist()
    pi = log_pi.exp()
    exact_pi, exact_q = float((pi * r).sum()), float((log_q.exp() * r).sum())
    exact_grad = pi * (r - (pi * r).sum())  # d E_pi[r] / d theta for pi = softmax(theta)
    b = 0.3
    want = {"plain": 0.0, "corrected": 0.0}
    grad = torch.zeros(6, dtype=torch.float64)
    for seq in itertools.permutations(range(6), 3):
        p_seq = ordered_prob(q, seq)
        s = list(seq)
        w = unordered_set_weights(log_q[s])
        rho = (log_pi[s] - log_q[s]).exp()
        want["plain"] += p_seq * float((w * r[s]).sum())
        want["corrected"] += p_seq * float((w * rho * r[s]).sum())
        for j, i in enumerate(s):  # grad log pi_1(i) = onehot(i) - pi
            grad += p_seq * w[j] * rho[j] * (r[i] - b) * (torch.eye(6, dtype=torch.float64)[i] - pi)
    assert want["plain"] == pytest.approx(exact_q, abs=1e-8)  # the tempered policy's reward
    assert abs(exact_q - exact_pi) > 0.02  # ... which is another figure
    assert want["corrected"] == pytest.approx(exact_pi, abs=1e-8)
    assert grad.tolist() == pytest.approx(exact_grad.tolist(), abs=1e-8)
