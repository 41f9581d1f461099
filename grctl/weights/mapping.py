"""HF checkpoint names -> our fused parameters.

Matching is on dotted segments (`.up_proj.`), never on substrings: `up_proj` is inside
`gate_up_proj`, and a substring match would route an already-fused name into the wrong shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from grctl.model.config import ModelConfig

# HF segment -> (fused segment, shard key). Shard keys index the row ranges of `shard_rows`.
PACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}

# Buffers some checkpoints carry that are not parameters here.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Target:
    """Where one HF tensor lands: rows [row_start, row_end) of a parameter (None: all of it)."""

    param_name: str
    row_start: int | None = None
    row_end: int | None = None

    @property
    def is_shard(self) -> bool:
        return self.row_start is not None


def shard_rows(cfg: ModelConfig, shard: str) -> tuple[int, int]:
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q": (0, q),
        "k": (q, q + kv),
        "v": (q + kv, q + 2 * kv),
        "gate": (0, inter),
        "up": (inter, 2 * inter),
    }[shard]


def param_name_of(hf_name: str, cfg: ModelConfig) -> str:
    """Strip the HF `model.` prefix and route a tied lm_head to the embedding it shares."""
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return "embed_tokens.weight"
    return name


def resolve(hf_name: str, cfg: ModelConfig) -> Target | None:
    """The target of `hf_name`, or None for a name that is known to carry nothing for us.

    Already-fused names (`layers.0.self_attn.qkv_proj.weight`) pass through whole. Whether the
    parameter exists is the caller's check (apply.plan), against the live model.
    """
    if hf_name.endswith(IGNORED_SUFFIXES):
        return None
    name = param_name_of(hf_name, cfg)
    dotted = "." + name
    for segment, (fused, shard) in PACKED.items():
        if segment in dotted:
            start, end = shard_rows(cfg, shard)
            return Target(dotted.replace(segment, fused, 1)[1:], start, end)
    return Target(name)


def hf_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name an HF Qwen3 checkpoint of this structure carries, in checkpoint order."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names
