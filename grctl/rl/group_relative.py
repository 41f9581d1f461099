"""Group-relative advantages over a request's beams, as the GR recipes use them (biased), and
sibling-relative advantages over the beams' trie (docs/rl-integration.md, "Which estimator").

Group-relative (GRPO over beams: OpenOneRec's and MiniOneRec's RL recipes, verl-GR): every
beam of one group gets A_s = (r_s - mean r) / (std r + eps), on all its tokens. Beams are not
i.i.d. draws of the policy (deterministic beams are no draws at all; stochastic beams are drawn
without replacement, so unlikely items are over-represented), so neither the mean nor the
gradient sum_s A_s grad log q(s) estimates E_q[r] or its gradient without bias: the mean of
k distinct beams weighs each item once whatever its probability. tests/rl/test_two_stage.py
measures the bias on a toy (bench/bench_estimators.py: the figures the docs give); the
unbiased forms are estimators.py's unordered set weights (one stage) and two_stage.py (reason,
then recommend).

Sibling-relative (V-STAR's Sibling-GRPO, arXiv 2602.10699, as its description reads: the
advantage of a branching decision relative to the siblings that share its trie prefix): the
beams' output ids form a tree (a node is a prefix; its parent the prefix one token shorter).
A node's value is the mean reward of the beams through it. At each token of each beam, the
decision is the child taken at its parent: its advantage is the child's value minus the mean
value of the parent's children that some beam took (each child once), divided by their std
(+ eps) when `scale`; a parent that only one child was taken from is no decision (advantage 0).
A heuristic as the group mean is: it is no unbiased estimate of the policy gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_relative_advantages(
    rewards: Sequence[float], *, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """[k] (r_s - mean r) / (std r + eps) over one group's beams (std with k - 1, as verl's
    GRPO); scale=False: r_s - mean r (Dr. GRPO's). One beam: 0."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.numel() < 2:
        return torch.zeros_like(r)
    centred = r - r.mean()
    return centred / (r.std() + eps) if scale else centred


def sibling_relative_advantages(
    output_ids: Sequence[Sequence[int]],
    rewards: Sequence[float],
    *,
    scale: bool = True,
    eps: float = 1e-6,
) -> list[torch.Tensor]:
    """Per beam, [len(output_ids[s])] per-token advantages relative to the siblings (module
    docstring). output_ids: the beams' searched tokens (the item stage's ids, after any forced
    prefix), every beam from the same root."""
    if len(output_ids) != len(rewards):
        raise ValueError("one reward per beam")
    r = [float(x) for x in rewards]
    totals: dict[tuple[int, ...], list[float]] = {}  # node -> [reward sum, beams]
    children: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for ids, reward in zip(output_ids, r, strict=True):
        path = tuple(int(t) for t in ids)
        for d in range(1, len(path) + 1):
            node = path[:d]
            acc = totals.setdefault(node, [0.0, 0.0])
            acc[0] += reward
            acc[1] += 1.0
            children.setdefault(path[: d - 1], set()).add(node)
    value = {node: s / c for node, (s, c) in totals.items()}
    stats: dict[tuple[int, ...], tuple[float, float]] = {}
    for parent, kids in children.items():
        if len(kids) < 2:
            continue
        vs = torch.tensor([value[k] for k in sorted(kids)], dtype=torch.float64)
        stats[parent] = (float(vs.mean()), float(vs.std()) + eps if scale else 1.0)
    out = []
    for ids in output_ids:
        path = tuple(int(t) for t in ids)
        adv = torch.zeros(len(path), dtype=torch.float64)
        for d in range(1, len(path) + 1):
            parent = path[: d - 1]
            if parent in stats:
                mean, div = stats[parent]
                adv[d - 1] = (value[path[:d]] - mean) / div
        out.append(adv)
    return out
