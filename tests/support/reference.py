"""transformers' Qwen3 as the independent reference: the same weights in ours, and its own greedy
generation, which every served or engine output is held to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from grctl.model.config import ModelConfig
from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.weights import apply
from tests.support.checkpoints import load_hf, make_hf_model

MAX_POS = 32  # the RoPE prompts run past it, where every scaling type differs from plain RoPE
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "mscale": 0.9,
        "mscale_all_dim": 0.7,
        "beta_fast": 16,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
}


def ours_from(hf: transformers.Qwen3ForCausalLM, raw_config: dict | None = None):
    """Our model holding the HF model's weights (through the weight sink)."""
    ours = Qwen3ForCausalLM(ModelConfig.from_hf(raw_config or hf.config.to_dict())).eval()
    apply.load_tensors(ours, list(hf.state_dict().items()), require_full=True)
    return ours


def hf_and_ours(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw):
    """A random HF Qwen3 and our model holding the same weights (through the weight sink)."""
    hf = make_hf_model(seed, **kw)
    ours = ours_from(hf)
    return hf.to(device, dtype), ours.to(device, dtype)


def rope_pair(kind: str, field: str):
    """hf_and_ours with the RoPE scaling ROPES[kind], our config read from `field`:
    transformers 5's rope_parameters, or rope_scaling as a config.json older than it holds."""
    rope = ROPES[kind]
    hf = make_hf_model(
        seed=5,
        rope_parameters={**rope, "rope_theta": 10000.0},
        max_position_embeddings=MAX_POS,
        head_dim=32,
    )
    raw = hf.config.to_dict()
    if field == "rope_scaling":
        raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
        raw["rope_scaling"] = dict(rope)
    ours = ours_from(hf, raw)
    assert ours.config.rope.rope_type == rope["rope_type"]
    return hf, ours


@torch.no_grad()
def hf_generate(
    model: transformers.Qwen3ForCausalLM | Path,
    prompt: Sequence[int],
    max_new_tokens: int = 4,
    **generate_kw,
) -> list[int]:
    """transformers' own greedy generation of `max_new_tokens` tokens after `prompt`, with an HF
    model or the checkpoint at a path; no EOS stop unless generate_kw names one."""
    hf = load_hf(model) if isinstance(model, Path) else model
    ids = torch.tensor([list(prompt)], device=hf.device)
    kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, **generate_kw}
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kw)
    return out[0, ids.shape[1] :].tolist()


def hf_token_logprobs(
    model: transformers.Qwen3ForCausalLM, ids: list[int], start: int, temperature: float = 1.0
) -> list[float]:
    """transformers' log_softmax(logits / T) of ids[start:], each given the ids before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[t - 1, ids[t]].item() for t in range(start, len(ids))]


def brute_force_beams(
    hf: transformers.Qwen3ForCausalLM, prompt: list[int], width: int, steps: int
) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """The best `width` sequences of `steps` tokens, step by step over all width x vocab
    continuations (every beam's full-vocabulary log_softmax added to its score, the best `width`
    of all of them), scored by transformers' float64 log_softmax: (sequences, scores) best first."""
    vocab = hf.config.vocab_size
    seqs = torch.tensor([prompt])
    scores = torch.zeros(1, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(seqs, attention_mask=torch.ones_like(seqs)).logits[:, -1]
        cand = scores[:, None] + torch.log_softmax(logits.double(), -1)
        top, flat = cand.flatten().topk(width)
        seqs = torch.cat((seqs[flat // vocab], (flat % vocab)[:, None]), 1)
        scores = top
    return [tuple(s[len(prompt) :].tolist()) for s in seqs], scores


def assert_beams_match(
    got: list[tuple[tuple[int, ...], float]], want: tuple[list[tuple[int, ...]], torch.Tensor]
) -> None:
    """`got` (output ids, sequence score) of a float32 search, best first, against
    brute_force_beams: distinct, the same scores, and the same sequences but those within
    rounding of the width-th score (float32 against float64 may swap them, nothing else)."""
    seqs, scores = want
    width = len(seqs)
    assert len(got) == width and len({ids for ids, _ in got}) == width
    ours = torch.tensor([s for _, s in got], dtype=torch.float64)
    assert torch.allclose(ours.sort(descending=True).values, scores, atol=1e-3)
    ref = dict(zip(seqs, scores.tolist(), strict=True))
    edge = scores[-1].item() + 1e-3
    missing = [(ids, s) for ids, s in got if ids not in ref]
    assert all(s <= edge for _, s in missing)
    assert len(missing) <= width // 50
    for ids, s in got[:16]:  # the best are the reference's best, with its scores
        assert ids in ref and abs(ref[ids] - s) < 1e-3
