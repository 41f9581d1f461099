"""The RL loop: rollouts through a real grctl server, the update in this process, the push of
the new weights back, step after step, with a Rich table of each step.

Step k rolls out under the weights labelled `step-k`: for every user one request of `group`
stochastic beams at temperature 1 under the served catalog (distinct items, a sample without
replacement), with each beam's behaviour logprobs, `sampling_logprob` and the request's
`gumbel_threshold`. The trainer (trainer.py) takes its update from them and pushes the tensors
it holds by the sync sequence (pause, flush, update, label `step-k+1`, resume), with no
checkpoint written. Before step 0 the trainer's weights are pushed as `step-0`, so the server
serves exactly what the trainer holds whatever it started with.

What each row reports, separately: the policy's exact expected reward E_pi[r] and its KL to the
frozen reference (enumerated over the whole catalog, the served policy of that step), the
estimator's E[r] from the beams, the plain mean reward of the beams, their slate metrics
(Recall@K, NDCG@K against the user's favourites, beams in the reply's order), and the ratio
statistics (the first epoch's max |rho - 1|, which the loop requires under RATIO_TOLERANCE).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from grctl.cli.rl.steps_table import steps_table
from grctl.cli.rl.task import Task
from grctl.cli.rl.trainer import DEFAULT_LR, Group, Sample, StepStats, Trainer, slate_metrics
from grctl.client.http import GRClient
from grctl.client.sync import WeightSync
from grctl.errors import GrctlError
from grctl.model.builtin import SID_LEVELS
from grctl.rl.estimators import whole_support_of

RATIO_TOLERANCE = 1e-4  # fp32: the server's decode and the trainer's replay on one weights


@dataclass
class StepRow:
    step: int
    weight_version: str  # the label the server reported on the step's rollouts
    exact_reward: float  # E_pi[r] of the served policy, mean over users (enumerated)
    kl_ref: float  # KL(pi || pi_ref), mean over users (enumerated)
    beam_reward: float  # the plain mean over the step's beams (biased: without replacement)
    recall: float  # Recall@group, mean over users
    ndcg: float  # NDCG@group, mean over users
    stats: StepStats
    rollout_s: float
    eval_s: float
    train_s: float
    push_s: float
    groups: list[Group] = field(repr=False, default_factory=list)


def rollout(gr: GRClient, task: Task, group: int, seed: int) -> list[Group]:
    """One batch /generate: per user `group` stochastic beams at temperature 1 under the served
    catalog, with logprobs; one Group per user, its beams in the reply's order (none for a
    user whose reply was aborted: its beams are partial, no estimator weights them)."""
    users = list(range(task.num_users))
    sp = {"max_new_tokens": SID_LEVELS, "temperature": 1.0, "n": group}
    params = [{**sp, "seed": seed * len(users) + u} for u in users]
    replies = gr.generate_batch([task.prompt(u) for u in users], params, return_logprob=True)
    groups = []
    for user, reply in zip(users, replies, strict=True):
        meta = reply.meta_info
        samples = []
        for b in meta.beam_results:
            lps = [entry[0] for entry in b.meta_info.output_token_logprobs or ()]
            lq = b.meta_info.sampling_logprob
            samples.append(
                Sample(
                    user,
                    task.prompt(user),
                    list(b.output_ids),
                    lps,
                    sum(lps) if lq is None else lq,
                    meta.weight_version,
                    task.reward(user, b.output_ids),
                )
            )
        try:
            whole = whole_support_of(meta)
        except ValueError:  # aborted (a weight push mid-rollout): partial beams, no estimator
            continue
        threshold = None if whole else float(meta.gumbel_threshold)
        groups.append(Group(user, samples, threshold, whole_support=whole))
    return groups


# E[r]: exact (enumerated) and the estimator's from the beams; beam: their plain mean; R, NDCG
# @K; KL to the reference (exact); |rho-1|: the first epoch's worst; rho: the last epoch's range
# (the time split is in summary())
COLUMNS = ("step", "E\\[r]", "est.", "beam", "R@K", "NDCG", "KL ref", "|rho-1|", "rho")


def step_table(rows: list[StepRow], total_steps: int) -> Table:
    cells = (
        (
            str(r.step),
            f"{r.exact_reward:.3f}",
            f"{r.stats.estimate:.3f}",
            f"{r.beam_reward:.3f}",
            f"{r.recall:.3f}",
            f"{r.ndcg:.3f}",
            f"{r.kl_ref:.3f}",
            f"{r.stats.first_ratio_gap:.0e}",
            f"{r.stats.ratio_min:.2f}-{r.stats.ratio_max:.2f}",
        )
        for r in rows
    )
    return steps_table(f"grctl demo --rl: {len(rows)}/{total_steps} steps", COLUMNS, cells)


def run_loop(
    url: str,
    task: Task,
    *,
    steps: int = 20,
    group: int = 8,
    lr: float = DEFAULT_LR,
    bucket_mb: float = 64,
    trainer: Trainer | None = None,
    console: Console | None = None,
) -> list[StepRow]:
    """Train for `steps` steps against the server at `url`, which serves the built-in model
    with `task`'s catalog and --allow-weight-update. Returns one StepRow per step."""
    console = console or Console()
    trainer = trainer or Trainer(task, lr=lr)
    rows: list[StepRow] = []
    with (
        GRClient(url) as gr,
        WeightSync(url, bucket_mb=bucket_mb) as sync,
        Live(step_table(rows, steps), console=console, auto_refresh=False) as live,
    ):
        sync.run(trainer.state_dict(), weight_version="step-0")
        for k in range(steps):
            t0 = time.perf_counter()
            groups = rollout(gr, task, group, seed=k)
            t1 = time.perf_counter()
            exact, kls = trainer.exact()  # the policy that was served for this rollout
            t2 = time.perf_counter()
            stats = trainer.step(groups)
            t3 = time.perf_counter()
            sync.run(trainer.state_dict(), weight_version=f"step-{k + 1}")
            t4 = time.perf_counter()
            samples = [s for g in groups for s in g.samples]
            slates = [
                slate_metrics(
                    [tuple(s.output_ids) for s in g.samples], task.preferred[g.user], k=group
                )
                for g in groups
            ]
            versions = sorted({s.weight_version for s in samples})
            label = versions[0] if len(versions) == 1 else "mixed: " + ", ".join(versions)
            rows.append(
                StepRow(
                    step=k,
                    weight_version=label,
                    exact_reward=sum(exact) / len(exact),
                    kl_ref=sum(kls) / len(kls),
                    beam_reward=sum(s.reward for s in samples) / len(samples),
                    recall=sum(m[0] for m in slates) / len(slates),
                    ndcg=sum(m[1] for m in slates) / len(slates),
                    stats=stats,
                    rollout_s=t1 - t0,
                    eval_s=t2 - t1,
                    train_s=t3 - t2,
                    push_s=t4 - t3,
                    groups=groups,
                )
            )
            live.update(step_table(rows, steps), refresh=True)
    return rows


def check(rows: list[StepRow]) -> None:
    """Raise GrctlError unless every rollout of step k came from `step-k` and the first epoch's
    ratios (the trainer's replay against grctl's behaviour logprobs) are 1 within tolerance."""
    for r in rows:
        wrong = {s.weight_version for g in r.groups for s in g.samples} - {f"step-{r.step}"}
        if wrong:
            raise GrctlError(f"step {r.step}'s rollouts were generated under {sorted(wrong)}")
        gap = max(r.stats.first_ratio_gap, r.stats.max_token_gap)
        if gap > RATIO_TOLERANCE:
            raise GrctlError(
                f"step {r.step}: the trainer's replayed logprobs differ from grctl's by {gap:.1e} "
                f"(more than {RATIO_TOLERANCE}): the two do not compute the same distribution"
            )


def summary(rows: list[StepRow], last: int = 5) -> dict[str, float]:
    """First and last `last` steps' exact expected reward and beam mean, the worst first-epoch
    ratio gap, the time split."""
    n = max(1, min(last, len(rows) // 2))  # two disjoint windows when the run allows

    def mean(xs):
        return sum(xs) / len(xs)

    return {
        "window": n,
        "exact_reward_first": mean([r.exact_reward for r in rows[:n]]),
        "exact_reward_last": mean([r.exact_reward for r in rows[-n:]]),
        "beam_reward_first": mean([r.beam_reward for r in rows[:n]]),
        "beam_reward_last": mean([r.beam_reward for r in rows[-n:]]),
        "kl_ref_last": rows[-1].kl_ref,
        "max_first_ratio_gap": max(r.stats.first_ratio_gap for r in rows),
        "max_token_gap": max(r.stats.max_token_gap for r in rows),
        "rollout_s": mean([r.rollout_s for r in rows]),
        "eval_s": mean([r.eval_s for r in rows]),
        "train_s": mean([r.train_s for r in rows]),
        "push_s": mean([r.push_s for r in rows]),
    }


def report(console: Console, rows: list[StepRow]) -> dict[str, float]:
    s = summary(rows)
    n = s["window"]
    console.line()  # after the live table
    console.print(
        f"exact E\\[r], first {n} steps {s['exact_reward_first']:.3f} -> last {n} "
        f"{s['exact_reward_last']:.3f} (beam mean {s['beam_reward_first']:.3f} -> "
        f"{s['beam_reward_last']:.3f}); KL to the reference {s['kl_ref_last']:.4f}; first-epoch "
        f"max |rho - 1| {s['max_first_ratio_gap']:.1e}; per step: rollout {s['rollout_s']:.2f} s, "
        f"exact eval {s['eval_s']:.2f} s, train {s['train_s']:.2f} s, push {s['push_s']:.2f} s"
    )
    return s


def write_curve(rows: list[StepRow], path: Path) -> Path | None:
    """The curves as a PNG (exact E[r], the estimate, the beam mean, NDCG; KL on a second
    axis); None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r.step for r in rows]
    fig, (ax, kx) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax.plot(steps, [r.exact_reward for r in rows], marker="o", label="E[r] exact (enumerated)")
    ax.plot(steps, [r.stats.estimate for r in rows], marker=".", label="E[r] estimate (beams)")
    ax.plot(steps, [r.beam_reward for r in rows], marker="x", label="mean beam reward")
    ax.plot(steps, [r.ndcg for r in rows], ls="--", label="NDCG@K")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    kx.plot(steps, [r.kl_ref for r in rows], marker="o", color="tab:red")
    kx.set_xlabel("step")
    kx.set_ylabel("KL(pi || pi_ref), exact")
    kx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
