"""The trainer side of the RL loop: transformers' Qwen3 holding the policy's weights (as a real
trainer holds its own), a frozen copy as the reference, and one update per step.

The update (docs/rl-integration.md, "What a loss should use"): each user's k beams are a sample
without replacement from the behaviour policy q (the served weights under the catalog at
temperature 1), so the step uses the unordered set estimator (or priority sampling) on the
beams' behaviour log-probabilities log q(y) (grctl's `sampling_logprob`), with the reward less
beta times log q(y) / pi_ref(y) (the KL to the reference folded into the reward), and PPO's
clipped ratio rho(y) = pi_theta(y) / q(y), pi_theta recomputed by the catalog replay from the
trainer's own logits. On the first epoch pi_theta is the served policy itself: rho is 1 up to
float error, which the loop checks.

Threads: trainer and server share the machine's cores. PyTorch's CPU ops run as OpenMP regions
whose idle workers spin-wait for the next region; two processes each spinning on all cores
take turns at a crawl (issue 28 measured this trainer's step at 7.6 s, 0.21 s without the
contention). So the trainer runs on `threads` torch threads (torch.set_num_threads, default
1: a 3.4M-parameter model gains nothing from more), and `grctl serve` starts with
OMP_WAIT_POLICY=passive (grctl/threads.py: idle OpenMP threads sleep instead of spinning; it
must be set before the process loads its OpenMP runtime, hence in the server, not here).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import transformers

from grctl.cli.rl.task import Task
from grctl.rl.estimators import priority_weights, unordered_set_advantages, unordered_set_weights
from grctl.rl.replay import CatalogReplay, Filters

PAD = 0
DEFAULT_LR = 1e-4  # Adam: E[r] 0.2 -> 0.9 in about 20 steps, KL to the reference ~3
ESTIMATORS = ("unordered_set", "priority")


@dataclass
class Sample:
    """One beam of a rollout, as grctl returned it."""

    user: int
    prompt: list[int]
    output_ids: list[int]
    logprobs: list[float]  # grctl's behaviour logprob of each output token
    sampling_logprob: float  # grctl's log q(beam): the sum of those
    weight_version: str
    reward: float = 0.0


@dataclass
class Group:
    """One request's beams (one user): a sample without replacement, and its threshold."""

    user: int
    samples: list[Sample]
    threshold: float | None = None  # gumbel_threshold: the (k+1)-th key; None: support drawn
    whole_support: bool = False


@dataclass
class StepStats:
    loss: float
    estimate: float  # the estimator's E[r] from the beams, mean over users
    kl_estimate: float  # the estimator's KL(q || pi_ref) from the beams, mean over users
    max_token_gap: float  # max |replayed token logprob - grctl's| on the served weights
    first_ratio_gap: float  # max |rho - 1| on the first epoch (0 up to float error)
    ratio_min: float  # over the last epoch's rho
    ratio_max: float
    clip_fraction: float  # beams whose last-epoch rho was outside [1 - eps, 1 + eps]
    epochs: list[dict] = field(default_factory=list)


def builtin_hf_model() -> transformers.Qwen3ForCausalLM:
    """transformers' Qwen3 with the built-in GR model's structure and fixed-seed weights."""
    from grctl.weights.loader import load_model
    from grctl.weights.views import hf_state_dict

    ours = load_model(None)
    cfg = transformers.Qwen3Config(**ours.config.to_hf())
    hf = transformers.Qwen3ForCausalLM(cfg)
    hf.load_state_dict(hf_state_dict(ours), strict=False)  # lm_head is tied to the embedding
    return hf.float()


class Trainer:
    def __init__(
        self,
        task: Task,
        model: transformers.Qwen3ForCausalLM | None = None,
        lr: float = DEFAULT_LR,
        *,
        beta: float = 0.02,
        clip: float = 0.2,
        epochs: int = 2,
        estimator: str = "unordered_set",
        threads: int | None = 1,
    ):
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, not {estimator!r}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.task = task
        self.model = model if model is not None else builtin_hf_model()
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.replay = CatalogReplay.parse(task.catalog_bytes())
        self.filters = Filters(temperature=1.0)
        self.beta, self.clip, self.epochs, self.estimator = beta, clip, epochs, estimator
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self._ref_items: torch.Tensor | None = None  # the reference's item logprobs, once

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What is pushed after each step: the HF-named tensors the trainer holds."""
        return self.model.state_dict()

    def logprobs(self, samples: list[Sample], model=None):
        """The replayed behaviour logprobs of each sample's tokens under `model` (default: the
        policy): Replayed, with gradient when the caller allows it."""
        model = model if model is not None else self.model
        prompts = [s.prompt for s in samples]
        outputs = [s.output_ids for s in samples]
        seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]
        width = max(len(q) for q in seqs)
        # right-padded: a causal model's positions before the padding never see it
        ids = torch.tensor([q + [PAD] * (width - len(q)) for q in seqs])
        logits = model(input_ids=ids).logits
        return self.replay.logprobs(logits, prompts, outputs, self.filters)

    @torch.no_grad()
    def item_logprobs(self, model) -> torch.Tensor:
        """[users, items] log pi(item | user) over the whole catalog (task.items' order) at
        temperature 1 under the catalog: one forward per user and distinct item prefix (the
        items sharing all but their last token share the logits that choose it), replayed."""
        paths = list(self.task.items)
        users = range(self.task.num_users)
        prefixes = sorted({p[:-1] for p in paths})
        index = {q: i for i, q in enumerate(prefixes)}
        seqs = [self.task.prompt(u) + list(q) for u in users for q in prefixes]
        width = max(map(len, seqs))
        ids = torch.tensor([q + [PAD] * (width - len(q)) for q in seqs])
        logits = model(input_ids=ids).logits.view(len(users), len(prefixes), width, -1)
        rows = torch.tensor([index[p[:-1]] for p in paths])
        out = []
        for u in users:
            prompts = [self.task.prompt(u)] * len(paths)
            got = self.replay.logprobs(logits[u, rows], prompts, [list(p) for p in paths])
            out.append(got.sequence().double())
        return torch.stack(out)

    def exact(self) -> tuple[list[float], list[float]]:
        """Per user, by enumeration over the whole catalog: the policy's expected reward
        E_pi[r] and KL(pi || pi_ref), pi at temperature 1 under the catalog (what is served)."""
        if self._ref_items is None:
            self._ref_items = self.item_logprobs(self.reference)
        lp = self.item_logprobs(self.model)
        paths = list(self.task.items)
        r = torch.tensor(
            [[self.task.reward(u, p) for p in paths] for u in range(self.task.num_users)],
            dtype=torch.float64,
        )
        p = lp.exp()
        return (p * r).sum(-1).tolist(), (p * (lp - self._ref_items)).sum(-1).tolist()

    def _weights(self, g: Group, lq: torch.Tensor, f: torch.Tensor) -> tuple:
        """(w, A): the estimator's weights of a group's beams (sum_s w_s f_s estimates E_q[f])
        and their advantages, so that sum_s w_s A_s grad log pi(s) estimates grad E_q[f]."""
        if self.estimator == "unordered_set":
            w = unordered_set_weights(lq, whole_support=g.whole_support)
            c = unordered_set_advantages(lq, f, whole_support=g.whole_support)
            return w, torch.where(w > 0, c / w.clamp(min=1e-300), torch.zeros_like(w))
        # priority sampling; the normalised estimate as baseline (a small bias, less variance)
        w = priority_weights(lq, g.threshold)
        baseline = (priority_weights(lq, g.threshold, normalize=True) * f).sum()
        return w, f - baseline

    def step(self, groups: list[Group]) -> StepStats:
        """`epochs` Adam steps of the clipped surrogate on one rollout (module docstring)."""
        samples = [s for g in groups for s in g.samples]
        served_lq = torch.tensor([s.sampling_logprob for s in samples], dtype=torch.float64)
        with torch.no_grad():
            ref_lq = self.logprobs(samples, self.reference).sequence().double()
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        shaped = rewards - self.beta * (served_lq - ref_lq)  # the KL to pi_ref in the reward
        weights, advantages, estimates, kl_estimates = [], [], [], []
        start = 0
        for g in groups:
            sl = slice(start, start + len(g.samples))
            start = sl.stop
            w, adv = self._weights(g, served_lq[sl], shaped[sl])
            weights.append(w)
            advantages.append(adv)
            estimates.append(float((w * rewards[sl]).sum()))
            kl_estimates.append(float((w * (served_lq[sl] - ref_lq[sl])).sum()))
        w = torch.cat(weights).float()
        adv = torch.cat(advantages).float()
        epochs, loss_value, token_gap = [], 0.0, 0.0
        for epoch in range(self.epochs):
            got = self.logprobs(samples)
            if epoch == 0:
                served = torch.zeros_like(got.output)
                for i, s in enumerate(samples):
                    served[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
                gap = (got.output.detach() - served).masked_fill(~got.output_mask, 0.0)
                token_gap = gap.abs().max().item()
            ratio = torch.exp(got.sequence() - served_lq.float())
            clipped = ratio.clamp(1 - self.clip, 1 + self.clip)
            surrogate = torch.minimum(ratio * adv, clipped * adv)
            loss = -(w * surrogate).sum() / len(groups)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            r = ratio.detach()
            epochs.append(
                {
                    "max_abs_ratio_minus_1": (r - 1).abs().max().item(),
                    "ratio_min": r.min().item(),
                    "ratio_max": r.max().item(),
                    "clip_fraction": ((r - 1).abs() > self.clip).float().mean().item(),
                }
            )
            loss_value = loss.item()
        last = epochs[-1]
        return StepStats(
            loss=loss_value,
            estimate=sum(estimates) / len(estimates),
            kl_estimate=sum(kl_estimates) / len(kl_estimates),
            max_token_gap=token_gap,
            first_ratio_gap=epochs[0]["max_abs_ratio_minus_1"],
            ratio_min=last["ratio_min"],
            ratio_max=last["ratio_max"],
            clip_fraction=last["clip_fraction"],
            epochs=epochs,
        )


def slate_metrics(ranked: list[tuple[int, ...]], relevant: frozenset, k: int) -> tuple:
    """(Recall@k, NDCG@k) of a ranked slate against the relevant items (binary relevance):
    recall = |top k & relevant| / |relevant|; NDCG = DCG / ideal DCG, DCG = sum over the top k
    of rel_i / log2(i + 2) (i from 0)."""
    top = ranked[:k]
    hits = [1.0 if item in relevant else 0.0 for item in top]
    recall = sum(hits) / len(relevant) if relevant else 0.0
    dcg = sum(h / math.log2(i + 2) for i, h in enumerate(hits))
    ideal = sum(1 / math.log2(i + 2) for i in range(min(k, len(relevant))))
    return recall, (dcg / ideal if ideal else 0.0)
