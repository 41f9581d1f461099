"""ModelConfig: the served model's structure, built once from an HF config.json and then frozen."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from grctl.errors import ValidationError
from grctl.model.rope import RopeScaling

# The fields that must match for a checkpoint to be loadable into a running model.
STRUCTURAL_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "intermediate_size",
)


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    rope: RopeScaling = RopeScaling()  # rope_parameters / rope_scaling

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, source: str | Path | dict) -> ModelConfig:
        """Read an HF Qwen3 config (a config.json path, a checkpoint dir, or its dict)."""
        if isinstance(source, dict):
            raw = source
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValidationError(f"no config.json at {path}")
            try:
                raw = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValidationError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValidationError("config.json must hold a JSON object")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(
                int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None
            )
            rope_theta = raw.get("rope_theta")
            if rope_theta is None:  # transformers 5 nests it under rope_parameters
                rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
            max_positions = int(raw.get("max_position_embeddings", 40960))
            return cls(
                num_layers=int(raw["num_hidden_layers"]),
                hidden_size=hidden,
                num_attention_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=max_positions,
                eos_token_ids=eos_ids,
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                rope=RopeScaling.from_hf(raw, max_positions),
            )
        except KeyError as exc:
            raise ValidationError(f"config.json lacks required key {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"config.json has a malformed value: {exc}") from exc

    def to_hf(self) -> dict:
        """The config.json a checkpoint of this model carries (transformers loads it)."""
        out = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": self.torch_dtype or "float32",
        }
        if self.rope.to_hf() is not None:  # transformers 5 reads both keys
            out["rope_scaling"] = self.rope.to_hf()
        if self.eos_token_ids:
            ids = list(self.eos_token_ids)
            out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        return out

    def structural_mismatches(self, other: ModelConfig) -> list[str]:
        """Each structural field where `other` differs, as 'field: served X, checkpoint Y'."""
        mine, theirs = asdict(self), asdict(other)
        return [
            f"{f}: served {mine[f]}, checkpoint {theirs[f]}"
            for f in STRUCTURAL_FIELDS
            if mine[f] != theirs[f]
        ]
