"""The two-stage toy of `grctl demo --rl --two-stage` and examples/two_stage_rl_loop.py: reason,
then recommend, on a Qwen3 small enough that every reasoning and every item can be enumerated.

The model is a tiny transformers Qwen3 (32 tokens, 2 layers, fixed seed) written as an HF
checkpoint that `grctl serve --model-path` loads. A prompt is [BOS, user]. Stage 1 samples a
reasoning of REASONING_LEN free tokens over the whole vocabulary at temperature 1 (ignore_eos:
always that many, so there are 32**2 = 1,024 reasonings); the forced prefix is one token, the
"<sid_begin>" of the toy; stage 2 draws items without replacement (stochastic beams at
temperature 1) from a 16-item catalog of two-token semantic IDs <a_i><b_j> (4 x 4 codes).

The reward needs both stages: an item pays 1 when its first code <a_i> is one of the tokens
the reasoning sampled, else 0. A policy that knows nothing reasons an <a_*> token about 23% of
the time and then picks the matching first code about one time in four: E[r] about 0.06. To raise
it the reasoning must learn to name an item's code and the item stage to follow the reasoning.

Exact evaluation: E[r] = sum_z pi(z) sum_y q(y | z) r(z, y) and KL((pi, q) || (pi_ref, q_ref))
= sum_z pi(z) [log pi(z) / pi_ref(z) + sum_y q(y | z) log q(y | z) / q_ref(y | z)], summed over
the 1,024 reasonings and 16 items, from transformers' logits: one forward per user, reasoning
and first code (the items sharing it share the logits that choose their second code).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

VOCAB = 32
PAD, BOS, EOS = 0, 1, 2
FIRST_USER = 3  # users are tokens 3, 4, ...
PREFIX = (7,)  # the forced prefix: the toy's <sid_begin>
FIRST_CODES = tuple(range(16, 20))  # <a_0> .. <a_3>
SECOND_CODES = tuple(range(24, 28))  # <b_0> .. <b_3>
REASONING_LEN = 2
MODEL_SEED = 0


def toy_config() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )


def toy_model(seed: int = MODEL_SEED) -> transformers.Qwen3ForCausalLM:
    """The toy policy's initial weights: transformers' own initialisation from `seed`."""
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(toy_config()).float().eval()


@dataclass(frozen=True)
class TwoStageTask:
    num_users: int = 2
    items: tuple[tuple[int, int], ...] = tuple((a, b) for a in FIRST_CODES for b in SECOND_CODES)

    def prompt(self, user: int) -> list[int]:
        return [BOS, FIRST_USER + user]

    @staticmethod
    def reward(reasoning, item) -> float:
        """1 when the item's first code is a token of the reasoning, else 0."""
        return 1.0 if item[0] in tuple(reasoning) else 0.0

    @property
    def item_ids(self) -> dict[tuple[int, int], str]:
        return {p: f"item-{i}" for i, p in enumerate(self.items)}

    def catalog_bytes(self) -> bytes:
        lines = (json.dumps({"item_id": i, "token_ids": list(p)}) for p, i in self.item_ids.items())
        return ("\n".join(lines) + "\n").encode()

    def write_catalog(self, path: Path) -> Path:
        path.write_bytes(self.catalog_bytes())
        return path

    def write_model(self, model: transformers.Qwen3ForCausalLM, path: Path) -> Path:
        """The checkpoint `grctl serve --model-path` loads (config.json, model.safetensors)."""
        model.save_pretrained(path)
        return path

    def sampling_params(self, *, reasoning_n: int, beams: int, seed: int) -> dict:
        """One multi-stage request's sampling_params (docs/http-api.md, grctl's spelling): both
        stages at temperature 1 with no filter, so the behaviour policy is the trained one."""
        return {
            "reasoning": {
                "n": reasoning_n,
                "max_new_tokens": REASONING_LEN,
                "temperature": 1.0,
                "ignore_eos": True,
                "seed": seed,
            },
            "forced_prefix": {"ids": list(PREFIX)},
            "n": beams,
            "max_new_tokens": 2,
            "temperature": 1.0,
            "seed": seed,
            "item_prefix_len": 0,
        }


def reasonings() -> list[tuple[int, ...]]:
    """Every reasoning stage 1 can sample: all REASONING_LEN-token sequences."""
    return list(itertools.product(range(VOCAB), repeat=REASONING_LEN))


@torch.no_grad()
def joint_logprobs(model, task: TwoStageTask, user: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([Z] log pi(z | user), [Z, I] log q(item | user, z, prefix)) over every reasoning z
    (reasonings()' order) and item (task.items' order), float64, from `model`'s logits: the
    reasoning's tokens by log_softmax over the whole vocabulary (temperature 1), the item's
    by log_softmax over the catalog's children of its prefix."""
    zs = torch.tensor(reasonings())
    firsts = sorted({a for a, _ in task.items})
    prompt = torch.tensor(task.prompt(user))
    p, r = len(task.prompt(user)), REASONING_LEN
    z_rep = zs.repeat_interleave(len(firsts), 0)  # [Z * F, R]
    a_col = torch.tensor(firsts).repeat(len(zs))[:, None]
    ids = torch.cat(
        (
            prompt.expand(len(z_rep), -1),
            z_rep,
            torch.tensor(PREFIX).expand(len(z_rep), -1),
            a_col,
        ),
        1,
    )
    logp = model(input_ids=ids).logits.double().log_softmax(-1)
    logp = logp.view(len(zs), len(firsts), ids.shape[1], VOCAB)
    # reasoning: position p - 1 + t predicts reasoning token t
    t_idx = torch.arange(r)
    lp_z = logp[:, 0, p - 1 + t_idx, :].gather(-1, zs[:, :, None])[..., 0].sum(-1)
    # first code: scored at the prefix's last position, over the catalog's first codes
    first_row = logp[:, 0, p + r + len(PREFIX) - 1, :]  # [Z, V] (the same for every a)
    first = first_row[:, firsts] - first_row[:, firsts].logsumexp(-1, keepdim=True)
    children = {a: [b for a2, b in task.items if a2 == a] for a in firsts}
    out = torch.empty(len(zs), len(task.items), dtype=torch.float64)
    for i, (a, b) in enumerate(task.items):
        fi = firsts.index(a)
        row = logp[:, fi, -1, :]  # the logits after <a>
        kids = children[a]
        second = row[:, b] - row[:, kids].logsumexp(-1)
        out[:, i] = first[:, fi] + second
    return lp_z, out


def rewards_table(task: TwoStageTask) -> torch.Tensor:
    """[Z, I] r(z, item)."""
    return torch.tensor(
        [[task.reward(z, y) for y in task.items] for z in reasonings()], dtype=torch.float64
    )


def all_logprobs(model, task: TwoStageTask) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """joint_logprobs for every user."""
    return [joint_logprobs(model, task, u) for u in range(task.num_users)]


def exact(
    policy: list[tuple[torch.Tensor, torch.Tensor]],
    reference: list[tuple[torch.Tensor, torch.Tensor]],
    task: TwoStageTask,
) -> tuple[list[float], list[float]]:
    """Per user, from all_logprobs of the policy and of the reference: the exact E[r] of the
    two-stage policy and its KL to the reference."""
    r = rewards_table(task)
    values, kls = [], []
    for (lz, lq), (rz, rq) in zip(policy, reference, strict=True):
        pz, q = lz.exp(), lq.exp()
        values.append(float((pz[:, None] * q * r).sum()))
        kl_items = (q * (lq - rq)).sum(-1)
        kls.append(float((pz * (lz - rz + kl_items)).sum()))
    return values, kls
