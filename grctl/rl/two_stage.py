"""The policy gradient of a two-stage rollout: reasoning sampled, then items drawn without
replacement given it (docs/rl-integration.md, "Two stages: reason, then recommend").

For one prompt the policy samples n reasonings z_1..z_n i.i.d. from pi(z) (stage 1, plain
sampling at temperature 1: its likelihood ratio is the score function), then, after the forced
prefix, draws for each z_i a set S_i of k distinct items from q(y | z_i) without replacement
(stage 2, stochastic beams: the Gumbel top-k over the catalog trie). The reward r(z, y) may
depend on both. The objective and its gradient:

    J = E_z[V(z)],  V(z) = E_{y ~ q(.|z)}[r(z, y)],
    grad J = E_z[ V(z) grad log pi(z) + E_{y ~ q(.|z)}[ r(z, y) grad log q(y | z) ] ].

Given z_i, the unordered set estimator (estimators.py) gives V_i = sum_{s in S_i} w_s r(z_i, s),
unbiased for V(z_i), and the item-stage gradient sum_s c_s grad log q(s | z_i) with its built-in
baseline B_s, unbiased for the inner expectation. So

    g = (1/n) sum_i [ (V_i - b_i) grad log pi(z_i) + sum_{s in S_i} c_{i,s} grad log q(s | z_i) ]

is unbiased for grad J for any baseline b_i independent of z_i given the others: here the
leave-one-out mean of the other reasonings' V_j (n >= 2; none at n = 1), and (1/n) sum_i V_i
estimates J. A trainer's loss is -(sum_i a_i log pi(z_i) + sum_{i,s} c_{i,s} log q(s | z_i)) / n
with a = V - b and c detached: log pi(z_i) is the sum of the reasoning's sampled tokens'
logprobs (the forced prefix has none: it is not drawn), log q(s | z_i) that of the item's.
Both stages must be drawn at temperature 1 with no filter for the behaviour policy to be the
trained one (else the gradient is the tempered, filtered policy's; docs/rl-integration.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grctl.rl.estimators import unordered_set_advantages, unordered_set_weights


@dataclass
class TwoStageEstimate:
    """One prompt's estimate: `value` estimates E[r]; `reasoning[i]` multiplies
    grad log pi(z_i) and `items[i][s]` grad log q(s | z_i), each divided by n already."""

    value: float
    values: torch.Tensor  # [n] V_i: the unordered set estimate of E[r | z_i]
    reasoning: torch.Tensor  # [n] (V_i - b_i) / n
    items: list[torch.Tensor]  # n tensors [k_i]: c_{i,s} / n


def two_stage_estimate(
    item_logprobs: Sequence[Sequence[float]],
    rewards: Sequence[Sequence[float]],
    *,
    whole_support: bool | Sequence[bool] = False,
    baseline: str = "leave_one_out",
) -> TwoStageEstimate:
    """The estimate and gradient coefficients of one prompt's n reasonings, from each
    reasoning's item beams: `item_logprobs[i]` the k_i beams' item-stage `sampling_logprob`
    (log q(s | z_i) under the behaviour policy), `rewards[i]` their r(z_i, s). whole_support
    (per reasoning, or one for all): that reasoning's beams hold every item (the group's
    `gumbel_threshold` is null, not for an abort), so its V_i is exact. baseline:
    "leave_one_out" (the mean of the other reasonings' V_j) or "none"."""
    n = len(item_logprobs)
    if n == 0 or len(rewards) != n:
        raise ValueError("one list of item logprobs and one of rewards per reasoning sample")
    if baseline not in ("leave_one_out", "none"):
        raise ValueError(f"baseline must be 'leave_one_out' or 'none', not {baseline!r}")
    whole = [whole_support] * n if isinstance(whole_support, bool) else list(whole_support)
    values, items = [], []
    for lq, r, full in zip(item_logprobs, rewards, whole, strict=True):
        f = torch.as_tensor(r, dtype=torch.float64)
        if len(lq) != f.numel() or f.numel() == 0:
            raise ValueError("each reasoning needs one reward per beam, and at least one beam")
        values.append((unordered_set_weights(lq, whole_support=full) * f).sum())
        items.append(unordered_set_advantages(lq, f, whole_support=full) / n)
    v = torch.stack(values)
    if baseline == "leave_one_out" and n >= 2:
        b = (v.sum() - v) / (n - 1)
    else:
        b = torch.zeros_like(v)
    return TwoStageEstimate(float(v.mean()), v, (v - b) / n, items)
