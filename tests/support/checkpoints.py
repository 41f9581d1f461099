"""Tiny random Qwen3 checkpoints written by transformers itself, the independent reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # deliberately not hidden_size / num_heads
    intermediate_size=96,
    vocab_size=128,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
)


def hf_config(**overrides) -> transformers.Qwen3Config:
    kw = {**TINY, **overrides}
    return transformers.Qwen3Config(**kw)


def make_hf_model(seed: int = 0, **overrides) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = hf_config(**overrides)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    # Non-trivial norms, so a mis-mapped norm weight shows up in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def write_checkpoint(
    path: Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    safe_serialization: bool = True,
    **overrides,
) -> Path:
    """Write a tiny random HF Qwen3 checkpoint to `path` and return it."""
    model = make_hf_model(seed, **overrides).to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    path = Path(path)
    if not safe_serialization:  # transformers 5 writes only safetensors: make the .bin ourselves
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        for f in path.glob("model*.safetensors*"):
            f.unlink()
        torch.save(state, path / "pytorch_model.bin")
    return path


def load_hf(path: Path, dtype: torch.dtype = torch.float32) -> transformers.Qwen3ForCausalLM:
    return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()


def write_word_tokenizer(path: Path) -> None:
    """A whitespace word tokenizer over the checkpoint's vocabulary: "t5 t9" <-> [5, 9]."""
    vocab_size = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.save_pretrained(path)


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of checkpoint `src` at `dst` whose tokenizer carries `template` as its chat
    template."""
    import shutil

    shutil.copytree(src, dst)
    tok = transformers.AutoTokenizer.from_pretrained(dst)
    tok.chat_template = template
    tok.save_pretrained(dst)
    return dst


def dir_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors files, read with safetensors."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
