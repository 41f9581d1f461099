"""The two-stage RL loop of `grctl demo --rl --two-stage` and examples/two_stage_rl_loop.py:
reason, then recommend, through a real grctl server, with the two-stage estimator
(grctl.rl.two_stage) and each step's weights pushed back (docs/rl-integration.md, "A loop that
learns through two stages").

Step k rolls out under the weights labelled `step-k`: one batch /generate, per user one
multi-stage request (two_stage_task.py: `reasoning_n` reasonings sampled at temperature 1, the
forced prefix, then `beams` stochastic beams over the catalog for each), every token's
behaviour logprob, each beam's item-stage `sampling_logprob` and each group's
`gumbel_threshold`. The trainer replays both stages on transformers' Qwen3 (the reasoning's
tokens by log_softmax, the item's by the catalog replay), takes the two-stage estimate per user
(the unordered set estimate V_i of each reasoning's value, its score function against the
leave-one-out baseline, plus the item stage's unordered set gradient), one Adam step, and
pushes its state dict by the sync sequence (pause, flush, update, label `step-k+1`, resume).

Each row: the policy's exact E[r] and its KL to the frozen reference (two_stage_task.exact:
enumerated over every reasoning and item, on the weights that were served for the step's
rollout), the estimator's E[r], the beams' plain mean (what GRPO over beams averages: biased),
the hit rate (a group with a paying beam), and the largest gap between the trainer's replayed
logprobs and the server's behaviour logprobs (the loop requires it under RATIO_TOLERANCE).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.live import Live
from rich.table import Table

from grctl.cli.rl.steps_table import steps_table
from grctl.cli.rl.two_stage_task import PAD, PREFIX, TwoStageTask, all_logprobs, exact, toy_model
from grctl.client.http import GRClient
from grctl.client.sync import WeightSync
from grctl.errors import GrctlError
from grctl.rl.estimators import whole_support_of
from grctl.rl.replay import CatalogReplay, Filters
from grctl.rl.two_stage import two_stage_estimate

RATIO_TOLERANCE = 1e-4  # fp32: the server's decode and the trainer's replay on one weights
DEFAULT_LR = 3e-3


@dataclass
class Beam:
    item: tuple[int, ...]
    item_logprobs: list[float]  # the server's behaviour logprob of each item token
    sampling_logprob: float  # log q(item | z): the item stage's
    reward: float


@dataclass
class Reasoning:
    """One reasoning sample and its item beams: a group."""

    user: int
    reasoning: list[int]
    reasoning_logprobs: list[float]  # the server's behaviour logprob of each reasoning token
    beams: list[Beam]
    whole_support: bool
    weight_version: str


@dataclass
class TwoStageStats:
    loss: float
    estimate: float  # the two-stage estimator's E[r], mean over users
    max_token_gap: float  # max |replayed logprob - the server's| over every sampled/searched token


@dataclass
class TwoStageRow:
    step: int
    weight_version: str
    exact_reward: float  # E[r] of the served policy, mean over users (enumerated)
    kl_ref: float  # KL to the frozen reference, mean over users (enumerated)
    estimate: float
    beam_reward: float  # the plain mean over every beam (GRPO's group mean: biased)
    hit_rate: float  # groups with at least one paying beam
    max_token_gap: float
    rollout_s: float
    eval_s: float
    train_s: float
    push_s: float
    groups: list[Reasoning] = field(repr=False, default_factory=list)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc.pop("groups")
        return doc


def rollout(
    gr: GRClient, task: TwoStageTask, *, reasoning_n: int, beams: int, seed: int
) -> list[Reasoning]:
    """One batch /generate of one multi-stage request per user; the groups in reply order (an
    aborted group, with no beams, is dropped: no estimator weights partial beams)."""
    users = list(range(task.num_users))
    params = [
        task.sampling_params(reasoning_n=reasoning_n, beams=beams, seed=seed * 1000 + 100 * u)
        for u in users
    ]
    replies = gr.generate_batch([task.prompt(u) for u in users], params)
    out = []
    for user, reply in zip(users, replies, strict=True):
        meta = reply.meta_info
        by_group: dict[int, list[Beam]] = {}
        reasoning_lps: dict[int, list[float]] = {}  # the same on every beam of a group
        for b in meta.beam_results:
            bm = b.meta_info
            spans = {s.kind: (s.start, s.end) for s in bm.stage_spans or ()}
            start, end = spans["searched"]
            item = tuple(b.output_ids[start:end])
            z = b.output_ids[slice(*spans["sampled"])]
            reasoning_lps.setdefault(
                bm.group_index, bm.behaviour_logprobs[slice(*spans["sampled"])]
            )
            by_group.setdefault(bm.group_index, []).append(
                Beam(
                    item,
                    list(bm.behaviour_logprobs[start:end]),
                    float(bm.sampling_logprob),
                    task.reward(z, item),
                )
            )
        for g in meta.stage_groups or ():
            if not by_group.get(g.index):
                continue
            try:
                whole = whole_support_of(g)
            except ValueError:
                continue
            z, lps = list(g.reasoning_ids), list(reasoning_lps[g.index])
            out.append(Reasoning(user, z, lps, by_group[g.index], whole, g.weight_version))
    return out


class TwoStageTrainer:
    """transformers' Qwen3 holding the toy policy, a frozen copy as the reference, one Adam
    step per rollout on the two-stage estimator's loss (module docstring)."""

    def __init__(
        self,
        task: TwoStageTask,
        model=None,
        lr: float = DEFAULT_LR,
        *,
        threads: int | None = 1,
    ):
        if threads is not None:
            torch.set_num_threads(threads)
        self.task = task
        self.model = model if model is not None else toy_model()
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.replay = CatalogReplay.parse(task.catalog_bytes())
        self.filters = Filters(temperature=1.0, item_prefix_len=0)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self._reference: list | None = None  # the reference's enumerated logprobs, once

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def exact(self) -> tuple[list[float], list[float]]:
        """Per user: the policy's exact E[r] and KL to the reference (enumerated)."""
        if self._reference is None:
            self._reference = all_logprobs(self.reference, self.task)
        return exact(all_logprobs(self.model, self.task), self._reference, self.task)

    def logprobs(self, groups: list[Reasoning]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per group: [R] the replayed reasoning tokens' logprobs and [k, 2] its beams' item
        tokens', with gradient: one forward over prompt + reasoning + prefix + item per beam."""
        prompts, items, owner = [], [], []
        for gi, g in enumerate(groups):
            for b in g.beams:
                prompts.append(self.task.prompt(g.user) + g.reasoning + list(PREFIX))
                items.append(list(b.item))
                owner.append(gi)
        seqs = [p + o for p, o in zip(prompts, items, strict=True)]
        width = max(map(len, seqs))
        ids = torch.tensor([q + [PAD] * (width - len(q)) for q in seqs])
        got = self.replay.logprobs(self.model(input_ids=ids).logits, prompts, items, self.filters)
        reasoning, item_lps, row = [], [], 0
        for g in groups:
            p, k = len(self.task.prompt(g.user)), len(g.beams)
            # prompt[j] scores prompt token j + 1: the reasoning's tokens are p .. p + R - 1
            reasoning.append(got.prompt[row, p - 1 : p - 1 + len(g.reasoning)])
            item_lps.append(got.output[row : row + k])
            row += k
        return reasoning, item_lps

    def step(self, groups: list[Reasoning]) -> TwoStageStats:
        reasoning, item_lps = self.logprobs(groups)
        gap = 0.0
        for g, lz, lq in zip(groups, reasoning, item_lps, strict=True):
            gap = max(gap, (lz.detach() - torch.tensor(g.reasoning_logprobs)).abs().max().item())
            served = torch.tensor([b.item_logprobs for b in g.beams])
            gap = max(gap, (lq.detach() - served).abs().max().item())
        loss = torch.zeros(())
        estimates = []
        users = sorted({g.user for g in groups})
        for u in users:
            idx = [i for i, g in enumerate(groups) if g.user == u]
            mine = [groups[i] for i in idx]
            est = two_stage_estimate(
                [[b.sampling_logprob for b in g.beams] for g in mine],
                [[b.reward for b in g.beams] for g in mine],
                whole_support=[g.whole_support for g in mine],
            )
            estimates.append(est.value)
            for i, a, c in zip(idx, est.reasoning.tolist(), est.items, strict=True):
                loss = loss - a * reasoning[i].sum() - (c.float() * item_lps[i].sum(-1)).sum()
        loss = loss / len(users)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return TwoStageStats(loss.item(), sum(estimates) / len(estimates), gap)


COLUMNS = ("step", "E\\[r]", "est.", "beam", "hit", "KL ref", "|lp gap|")


def step_table(rows: list[TwoStageRow], total_steps: int) -> Table:
    cells = (
        (
            str(r.step),
            f"{r.exact_reward:.3f}",
            f"{r.estimate:.3f}",
            f"{r.beam_reward:.3f}",
            f"{r.hit_rate:.3f}",
            f"{r.kl_ref:.3f}",
            f"{r.max_token_gap:.0e}",
        )
        for r in rows
    )
    title = f"grctl demo --rl --two-stage: {len(rows)}/{total_steps} steps"
    return steps_table(title, COLUMNS, cells)


def run_two_stage_loop(
    url: str,
    task: TwoStageTask,
    *,
    steps: int = 20,
    reasoning_n: int = 4,
    beams: int = 4,
    lr: float = DEFAULT_LR,
    trainer: TwoStageTrainer | None = None,
    console: Console | None = None,
) -> list[TwoStageRow]:
    """Train for `steps` steps against the server at `url`, which serves the toy's model and
    catalog with --allow-weight-update. Returns one row per step."""
    console = console or Console()
    trainer = trainer or TwoStageTrainer(task, lr=lr)
    rows: list[TwoStageRow] = []
    with (
        GRClient(url) as gr,
        WeightSync(url, bucket_mb=64) as sync,
        Live(step_table(rows, steps), console=console, auto_refresh=False) as live,
    ):
        sync.run(trainer.state_dict(), weight_version="step-0")
        for k in range(steps):
            t0 = time.perf_counter()
            groups = rollout(gr, task, reasoning_n=reasoning_n, beams=beams, seed=k)
            t1 = time.perf_counter()
            values, kls = trainer.exact()  # the policy that was served for this rollout
            t2 = time.perf_counter()
            stats = trainer.step(groups)
            t3 = time.perf_counter()
            sync.run(trainer.state_dict(), weight_version=f"step-{k + 1}")
            t4 = time.perf_counter()
            all_beams = [b for g in groups for b in g.beams]
            versions = sorted({g.weight_version for g in groups})
            rows.append(
                TwoStageRow(
                    step=k,
                    weight_version=versions[0] if len(versions) == 1 else ", ".join(versions),
                    exact_reward=sum(values) / len(values),
                    kl_ref=sum(kls) / len(kls),
                    estimate=stats.estimate,
                    beam_reward=sum(b.reward for b in all_beams) / len(all_beams),
                    hit_rate=sum(any(b.reward > 0 for b in g.beams) for g in groups) / len(groups),
                    max_token_gap=stats.max_token_gap,
                    rollout_s=t1 - t0,
                    eval_s=t2 - t1,
                    train_s=t3 - t2,
                    push_s=t4 - t3,
                    groups=groups,
                )
            )
            live.update(step_table(rows, steps), refresh=True)
    return rows


def check(rows: list[TwoStageRow], reasoning_n: int, num_users: int) -> None:
    """Raise GrctlError unless every group of step k came from `step-k` (one version per
    sample), none was dropped, and the trainer's replay equals the server's logprobs."""
    for r in rows:
        wrong = {g.weight_version for g in r.groups} - {f"step-{r.step}"}
        if wrong:
            raise GrctlError(f"step {r.step}'s samples were generated under {sorted(wrong)}")
        if len(r.groups) != reasoning_n * num_users:
            raise GrctlError(
                f"step {r.step}: {len(r.groups)} groups came back, not {reasoning_n * num_users}"
            )
        if r.max_token_gap > RATIO_TOLERANCE:
            raise GrctlError(
                f"step {r.step}: the trainer's replayed logprobs differ from grctl's by "
                f"{r.max_token_gap:.1e} (more than {RATIO_TOLERANCE})"
            )


def summary(rows: list[TwoStageRow], last: int = 3) -> dict[str, float]:
    n = max(1, min(last, len(rows) // 2))

    def mean(xs):
        return sum(xs) / len(xs)

    return {
        "window": n,
        "exact_reward_first": rows[0].exact_reward,
        "exact_reward_last": rows[-1].exact_reward,
        "exact_reward_last_window": mean([r.exact_reward for r in rows[-n:]]),
        "beam_reward_first": mean([r.beam_reward for r in rows[:n]]),
        "beam_reward_last": mean([r.beam_reward for r in rows[-n:]]),
        "kl_ref_last": rows[-1].kl_ref,
        "max_token_gap": max(r.max_token_gap for r in rows),
        "rollout_s": mean([r.rollout_s for r in rows]),
        "eval_s": mean([r.eval_s for r in rows]),
        "train_s": mean([r.train_s for r in rows]),
        "push_s": mean([r.push_s for r in rows]),
    }


def report(console: Console, rows: list[TwoStageRow]) -> dict[str, float]:
    s = summary(rows)
    console.line()
    console.print(
        f"exact E\\[r] {s['exact_reward_first']:.3f} -> {s['exact_reward_last']:.3f} (beam mean "
        f"{s['beam_reward_first']:.3f} -> {s['beam_reward_last']:.3f}, first and last "
        f"{s['window']} steps); KL to the reference {s['kl_ref_last']:.3f}; max |logprob gap| "
        f"{s['max_token_gap']:.1e}; per step: rollout {s['rollout_s']:.2f} s, exact eval "
        f"{s['eval_s']:.2f} s, train {s['train_s']:.2f} s, push {s['push_s']:.2f} s"
    )
    return s
