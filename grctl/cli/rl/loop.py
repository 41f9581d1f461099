"""The RL loop: rollouts through a real grctl server, the update in this process, the push of
the new weights back, step after step, with a Rich table of each step.

Step k rolls out under the weights labelled `step-k`: for every user, a group of items sampled
at temperature 1 under the served catalog (stochastic beams: distinct items), with grctl's
per-token logprobs of each. The trainer recomputes those logprobs on the same weights (their
gap is the importance ratio's log r, zero up to float error), takes one policy-gradient step
with the group's mean reward as baseline, and pushes the tensors it holds by the sync
sequence (pause, flush, update, label `step-k+1`, resume), with no checkpoint written. Before
step 0 the trainer's weights are pushed as `step-0`, so the server serves exactly what the
trainer holds whatever it started with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from grctl.cli.rl.task import Task
from grctl.cli.rl.trainer import DEFAULT_LR, Sample, StepStats, Trainer
from grctl.client.http import GRClient
from grctl.client.sync import WeightSync
from grctl.errors import GrctlError, ValidationError
from grctl.model.builtin import SID_LEVELS

LOGPROB_TOLERANCE = 1e-4  # fp32: the server's decode and the trainer's forward on one weights


@dataclass
class StepRow:
    step: int
    weight_version: str  # the label the server reported on the step's rollouts
    reward: float  # mean over the step's samples
    stats: StepStats
    rollout_s: float
    train_s: float
    push_s: float
    samples: list[Sample] = field(repr=False, default_factory=list)


ROLLOUTS = ("beams", "samples")


def rollout(
    gr: GRClient, task: Task, group: int, seed: int, how: str = "beams"
) -> tuple[list[Sample], list[int]]:
    """`group` items for every user, in one batch /generate at temperature 1 under the served
    catalog, with logprobs; returns the samples and each one's group (its user).

    how="beams": one request per user, `n = group` stochastic beams (distinct items, sampled
    without replacement), each beam's logprobs under meta_info.beam_results[i].
    how="samples": `group` independent requests per user (n = 1, seeds apart), which may name
    one item twice (GRPO's sampling with replacement)."""
    if how not in ROLLOUTS:
        raise ValidationError(f"rollouts must be one of {ROLLOUTS}, not {how!r}")
    sp = {"max_new_tokens": SID_LEVELS, "temperature": 1.0}
    if how == "beams":
        users = list(range(task.num_users))
        params = [{**sp, "n": group, "seed": seed * len(users) + u} for u in users]
    else:
        users = [u for u in range(task.num_users) for _ in range(group)]
        params = [{**sp, "seed": seed * len(users) + i} for i in range(len(users))]
    replies = gr.generate_batch([task.prompt(u) for u in users], params, return_logprob=True)
    samples, groups = [], []
    for user, reply in zip(users, replies, strict=True):
        meta = reply.meta_info
        beams = (
            [(b.output_ids, b.meta_info.output_token_logprobs) for b in meta.beam_results]
            if how == "beams"
            else [(reply.output_ids, meta.output_token_logprobs)]
        )
        for ids, logprobs in beams:
            lps = [entry[0] for entry in logprobs or ()]
            reward = task.reward(user, ids)
            samples.append(
                Sample(user, task.prompt(user), list(ids), lps, meta.weight_version, reward)
            )
            groups.append(user)
    return samples, groups


COLUMNS = ("step", "weights", "reward", "KL", "max |log r|", "rollout ms", "train ms", "push ms")


def step_table(rows: list[StepRow], total_steps: int) -> Table:
    table = Table(title=f"grctl demo --rl: {len(rows)}/{total_steps} steps", title_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.step),
            r.weight_version,
            f"{r.reward:.3f}",
            f"{r.stats.kl:.4f}",
            f"{r.stats.max_abs_log_ratio:.1e}",
            f"{1000 * r.rollout_s:.0f}",
            f"{1000 * r.train_s:.0f}",
            f"{1000 * r.push_s:.0f}",
        )
    return table


def run_loop(
    url: str,
    task: Task,
    *,
    steps: int = 20,
    group: int = 8,
    lr: float = DEFAULT_LR,
    bucket_mb: float = 64,
    rollouts: str = "beams",
    trainer: Trainer | None = None,
    console: Console | None = None,
) -> list[StepRow]:
    """Train for `steps` steps against the server at `url`, which serves the built-in model
    with `task`'s catalog and --allow-weight-update; `rollouts`: how each step samples (see
    rollout). Returns one StepRow per step."""
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
            samples, groups = rollout(gr, task, group, seed=k, how=rollouts)
            t1 = time.perf_counter()
            stats = trainer.step(samples, groups)
            t2 = time.perf_counter()
            sync.run(trainer.state_dict(), weight_version=f"step-{k + 1}")
            t3 = time.perf_counter()
            reward = sum(s.reward for s in samples) / len(samples)
            versions = sorted({s.weight_version for s in samples})
            label = versions[0] if len(versions) == 1 else "mixed: " + ", ".join(versions)
            rows.append(StepRow(k, label, reward, stats, t1 - t0, t2 - t1, t3 - t2, samples))
            live.update(step_table(rows, steps), refresh=True)
    return rows


def check(rows: list[StepRow]) -> None:
    """Raise GrctlError unless every rollout of step k came from `step-k` and grctl's logprobs
    equal the trainer's recompute within LOGPROB_TOLERANCE."""
    for r in rows:
        wrong = {s.weight_version for s in r.samples} - {f"step-{r.step}"}
        if wrong:
            raise GrctlError(f"step {r.step}'s rollouts were generated under {sorted(wrong)}")
        if r.stats.max_abs_log_ratio > LOGPROB_TOLERANCE:
            raise GrctlError(
                f"step {r.step}: grctl's logprobs differ from the trainer's by "
                f"{r.stats.max_abs_log_ratio:.1e} (more than {LOGPROB_TOLERANCE})"
            )


def summary(rows: list[StepRow], last: int = 5) -> dict[str, float]:
    """Mean reward of the first and last `last` steps, the worst log r, the time split."""
    n = min(last, len(rows))
    return {
        "reward_first": sum(r.reward for r in rows[:n]) / n,
        "reward_last": sum(r.reward for r in rows[-n:]) / n,
        "max_abs_log_ratio": max(r.stats.max_abs_log_ratio for r in rows),
        "rollout_s": sum(r.rollout_s for r in rows) / len(rows),
        "train_s": sum(r.train_s for r in rows) / len(rows),
        "push_s": sum(r.push_s for r in rows) / len(rows),
    }


def write_curve(rows: list[StepRow], path: Path) -> Path | None:
    """The reward curve as a PNG; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r.step for r in rows], [r.reward for r in rows], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
