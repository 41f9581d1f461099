"""The FLOPs a request needs at least: the floor a measured time is held to.

Counted as the engine must compute them, 2 FLOPs per multiply-add: the prefill runs every layer
over every prompt token except the last layer, which needs k and v of every token but q,
attention, o_proj and the MLP of the last token only; causal attention counts each query's keys
up to itself; the head runs on the rows whose logits are used (one per prompt, one per decoded
row). A decode row attends to its whole context plus its tail (this token included). Norms,
RoPE and softmax are left out (under 1 % at these shapes).
"""

from __future__ import annotations

from grctl.model.config import ModelConfig


def _layer_macs(cfg: ModelConfig) -> tuple[int, int]:
    """Per token and layer: (k and v projections, everything else dense)."""
    h = cfg.hidden_size
    kv = h * 2 * cfg.kv_size
    rest = h * cfg.q_size + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return kv, rest


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    kv, rest = _layer_macs(cfg)
    heads = cfg.num_attention_heads * cfg.head_dim
    layers = cfg.num_layers - 1
    dense = layers * tokens * (kv + rest) + tokens * kv + rest
    attention = 2 * heads * (layers * tokens * (tokens + 1) // 2 + tokens)  # QK^T and PV
    head = cfg.hidden_size * cfg.vocab_size
    return 2.0 * (dense + attention + head)


def decode_flops(cfg: ModelConfig, rows: int, keys: int) -> float:
    """One decode step of `rows` rows, each attending to `keys` keys (context + tail)."""
    kv, rest = _layer_macs(cfg)
    heads = cfg.num_attention_heads * cfg.head_dim
    per_row = cfg.num_layers * (kv + rest + 2 * heads * keys) + cfg.hidden_size * cfg.vocab_size
    return 2.0 * rows * per_row


def request_flops(cfg: ModelConfig, prompt: int, beams: int, new_tokens: int) -> float:
    """A whole request: its prefill (the first token), then new_tokens - 1 decode steps."""
    steps = sum(decode_flops(cfg, beams, prompt + s + 1) for s in range(new_tokens - 1))
    return prefill_flops(cfg, prompt) + steps
