"""The built-in GR model: its structure, its name, its vocabulary and its fixed-seed weights.

With no --model-path, `grctl serve` serves this model, so it works out of the box.
"""

from __future__ import annotations

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


def init_default_weights(model: Qwen3ForCausalLM, seed: int = DEFAULT_SEED) -> None:
    """Fill the built-in model from a fixed seed: the same weights at every start."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a fixed order
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            else:
                values = 0.05 * torch.randn(p.shape, generator=gen)
            p.copy_(values)
