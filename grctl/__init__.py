"""grctl: a rollout engine for generative-recommendation Qwen3 models with in-place weight sync."""

__version__ = "0.1.0"
