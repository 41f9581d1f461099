"""The trainer side of the RL loop: transformers' Qwen3 holding the policy's weights (as a real
trainer holds its own), the log-probabilities it recomputes for the rollouts, and one
policy-gradient step with a group baseline (GRPO's advantage).

Two log-probabilities per output token: `raw`, log_softmax(logits / T) over the whole
vocabulary (what grctl reports with return_original_logprob); and `masked`, the same logits
renormalised over the catalog's allowed tokens at that position, the distribution the server
actually samples from under its catalog, which grctl reports by default (the behaviour
policy's), so the two must agree on the same weights, and which the policy gradient
differentiates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from grctl.cli.rl.task import Task

PAD = 0
DEFAULT_LR = 3e-4  # Adam: 20 steps take the demo's reward from 0.1 to 0.8 without collapse


@dataclass
class Sample:
    """One rollout: the item recommended to `user`, as grctl returned it."""

    user: int
    prompt: list[int]
    output_ids: list[int]
    logprobs: list[float]  # grctl's, one per output token
    weight_version: str  # the label of the weights it was generated with
    reward: float = 0.0


@dataclass
class StepStats:
    loss: float
    max_abs_log_ratio: float  # max |trainer's masked logprob - grctl's| before the update
    kl: float  # KL(rollout policy || updated policy), k3 estimate summed over tokens, mean


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
        temperature: float = 1.0,
    ):
        self.task = task
        self.model = model if model is not None else builtin_hf_model()
        self.temperature = temperature
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What is pushed after each step: the HF-named tensors the trainer holds."""
        return self.model.state_dict()

    def logprobs(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(raw, masked, valid), each [samples, longest output]: see the module docstring."""
        seqs = [s.prompt + s.output_ids for s in samples]
        width = max(len(q) for q in seqs)
        # right-padded: a causal model's positions before the padding never see it
        ids = torch.tensor([q + [PAD] * (width - len(q)) for q in seqs])
        logits = self.model(input_ids=ids).logits.float() / self.temperature  # [N, S, V]
        n, steps, vocab = len(samples), max(len(s.output_ids) for s in samples), logits.shape[-1]
        step_logits = logits.new_zeros(n, steps, vocab)  # [i, t]: the logits that chose token t
        chosen = torch.zeros(n, steps, dtype=torch.int64)
        valid = torch.zeros(n, steps, dtype=torch.bool)
        # padding allows every token: a finite log-sum-exp, so no NaN reaches the gradient
        allowed = torch.ones(n, steps, vocab, dtype=torch.bool)
        for i, s in enumerate(samples):
            m, start = len(s.output_ids), len(s.prompt) - 1
            step_logits[i, :m] = logits[i, start : start + m]
            chosen[i, :m] = torch.tensor(s.output_ids)
            valid[i, :m] = True
            for t, token in enumerate(s.output_ids):
                children = self.task.children.get(tuple(s.output_ids[:t]), ())
                allowed[i, t] = False
                allowed[i, t, [*children, token]] = True
        picked = step_logits.gather(-1, chosen[..., None])[..., 0]
        raw = picked - step_logits.logsumexp(-1)
        masked = picked - step_logits.masked_fill(~allowed, float("-inf")).logsumexp(-1)
        return raw.masked_fill(~valid, 0.0), masked.masked_fill(~valid, 0.0), valid

    def step(self, samples: list[Sample], group_of: list[int]) -> StepStats:
        """One Adam step of -sum_i A_i * log pi(y_i), with A_i the sample's reward minus its
        group's mean, over the group's standard deviation (`group_of[i]`: sample i's group)."""
        raw, masked, valid = self.logprobs(samples)
        served = torch.zeros_like(raw)
        for i, s in enumerate(samples):
            served[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
        # the served logprobs are the behaviour policy's: the catalog-masked distribution
        log_ratio = (masked.detach() - served).masked_fill(~valid, 0.0)
        rewards = torch.tensor([s.reward for s in samples])
        groups = torch.tensor(group_of)
        advantages = torch.zeros_like(rewards)
        for g in groups.unique():
            members = groups == g
            r = rewards[members]
            advantages[members] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        loss = -(advantages * masked.sum(-1)).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            _, after, _ = self.logprobs(samples)
        # k3: r - 1 - log r with r = pi_new / pi_rollout, on tokens drawn from the rollout policy
        log_r = (after - masked.detach()).masked_fill(~valid, 0.0)
        kl = (log_r.exp() - 1 - log_r).sum(-1).mean()
        return StepStats(loss.item(), log_ratio.abs().max().item(), kl.item())
