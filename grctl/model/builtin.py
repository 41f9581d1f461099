"""The built-in GR model: its structure, its name, its vocabulary and its fixed-seed weights.

With no --model-path, `grctl serve` serves this model, so it works out of the box. Its weights
are a source like a checkpoint: weights/loader.py writes them through the one sink.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from grctl.model.config import ModelConfig
from grctl.model.qwen3 import Qwen3ForCausalLM

# The built-in GR model: ids 0-255 are text and special tokens (0 pad, 1 bos, 2 eos), then three
# semantic-ID levels of 256 codes each, so an item is three tokens <a_i><b_j><c_k>.
NUM_TEXT_TOKENS = 256
SID_LEVELS = 3
SID_CODES = 256
DEFAULT_SEED = 20261130
DEFAULT_CONFIG = ModelConfig(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=NUM_TEXT_TOKENS + SID_LEVELS * SID_CODES,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=8192,
    eos_token_ids=(2,),
    torch_dtype="float32",
)
DEFAULT_MODEL_NAME = "grctl-builtin-gr"


def builtin_weights(
    model: Qwen3ForCausalLM, seed: int = DEFAULT_SEED
) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, float32 values) for every parameter of `model`, drawn from a fixed
    seed in a fixed order: the same weights at every start."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            yield name, 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            yield name, 0.05 * torch.randn(p.shape, generator=gen)
