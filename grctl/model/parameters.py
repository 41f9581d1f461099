"""The served model's parameters by name and shape, from ModelConfig alone (no module built).

The names are our Qwen3's (`layers.0.self_attn.qkv_proj.weight`, fused); a client plans a push
against them without building a model, and tests hold them to `Qwen3ForCausalLM`'s own
`named_parameters()`.
"""

from __future__ import annotations

from grctl.model.config import ModelConfig


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of `Qwen3ForCausalLM(cfg)`, name -> shape, in its module order."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "self_attn.qkv_proj.weight"] = (cfg.q_size + 2 * cfg.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes
