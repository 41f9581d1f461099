"""The two-stage estimator against GRPO over beams, on the enumerable toy of
tests/rl/test_two_stage.py, in one run: the figures docs/rl-integration.md gives.

    python bench/bench_estimators.py [--rollouts 20000] [--seed 1]

The toy: 9 two-token reasonings sampled i.i.d. (n = 3 per rollout), then for each k = 3 of a
6-item two-level catalog drawn without replacement (Gumbel top-k), a reward of both. The exact
E[r] and its gradient come from enumeration with autograd. Prints one JSON object: per
estimator the mean of the E[r] estimates, their standard error and z against the exact value;
per gradient (the two-stage estimator's, and GRPO's: (r - mean r) / std r of a reasoning's beams
on its reasoning's and its item's tokens, averaged over the n * k beams) the cosine of the mean
gradient with the exact one, its relative error (|mean - exact| / |exact|), and the norm of
GRPO's reasoning part (the advantages of one reasoning's beams sum to 0, so it is 0).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grctl.rl.group_relative import group_relative_advantages  # noqa: E402
from grctl.rl.two_stage import two_stage_estimate  # noqa: E402
from tests.rl.test_two_stage import N, Toy, rollouts  # noqa: E402


def mean_se(xs: list[float]) -> tuple[float, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(len(xs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    toy = Toy()
    exact_j, exact_g = toy.exact()
    gp, gq = toy.score_vectors()
    values, group_means = [], []
    grad_sum = torch.zeros_like(exact_g)
    grpo_sum = torch.zeros_like(exact_g)
    grpo_reasoning_sum = torch.zeros_like(exact_g)
    for zs, beams, lq in rollouts(toy, args.rollouts, seed=args.seed):
        rewards = [toy.reward[z, b] for z, b in zip(zs, beams, strict=True)]
        est = two_stage_estimate(
            [lq[z, b].tolist() for z, b in zip(zs, beams, strict=True)],
            [r.tolist() for r in rewards],
        )
        values.append(est.value)
        g = sum(a * gp[z] for a, z in zip(est.reasoning.tolist(), zs, strict=True))
        for z, b, c in zip(zs, beams, est.items, strict=True):
            g = g + (c[:, None] * gq[z, b]).sum(0)
        grad_sum += g
        group_means.append(sum(float(r.mean()) for r in rewards) / N)
        for z, b, r in zip(zs, beams, rewards, strict=True):
            adv = group_relative_advantages(r)
            part = adv.sum() * gp[z]  # every beam carries the same reasoning tokens
            grpo_reasoning_sum += part / (N * len(b))
            grpo_sum += (part + (adv[:, None] * gq[z, b]).sum(0)) / (N * len(b))
    n = args.rollouts

    def against_exact(total: torch.Tensor) -> dict:
        mean = total / n
        cos = float(mean @ exact_g / (mean.norm() * exact_g.norm()))
        return {"cosine": cos, "relative_error": float((mean - exact_g).norm() / exact_g.norm())}

    out = {"rollouts": n, "n": N, "k": 3, "exact_value": exact_j}
    for name, xs in (("two_stage", values), ("group_mean", group_means)):
        m, se = mean_se(xs)
        out[name] = {"mean": m, "se": se, "z": (m - exact_j) / se}
    out["two_stage_gradient"] = against_exact(grad_sum)
    out["grpo_gradient"] = {
        **against_exact(grpo_sum),
        "reasoning_part_norm": float((grpo_reasoning_sum / n).norm()),
    }
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
