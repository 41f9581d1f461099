"""Shared bench helpers: a large random HF-named checkpoint, memory readings, a memcpy reference."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from grctl.model import dtypes
from grctl.model.config import ModelConfig
from grctl.weights.mapping import hf_names

# About 1.08 GB in bf16 (540M parameters), HF Qwen3 layout, untied.
ONE_GIB_CONFIG = ModelConfig(
    num_layers=16,
    hidden_size=1536,
    num_attention_heads=12,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=4608,
    vocab_size=32768,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {}
    for name in hf_names(cfg):
        leaf = name.split(".")[-2]
        shapes[name] = {
            "embed_tokens": (cfg.vocab_size, h),
            "lm_head": (cfg.vocab_size, h),
            "q_proj": (cfg.q_size, h),
            "k_proj": (cfg.kv_size, h),
            "v_proj": (cfg.kv_size, h),
            "o_proj": (h, cfg.q_size),
            "q_norm": (cfg.head_dim,),
            "k_norm": (cfg.head_dim,),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }.get(leaf, (h,))
    return shapes


def write_random_checkpoint(path: Path, cfg: ModelConfig, num_shards: int = 4, seed: int = 0):
    """A random checkpoint in HF layout, sharded with an index; returns its size in bytes."""
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtypes.SERVED_DTYPES[cfg.torch_dtype or "float32"]
    gen = torch.Generator().manual_seed(seed)
    shapes = hf_shapes(cfg)
    names = list(shapes)
    per_shard = -(-len(names) // num_shards)
    weight_map, total = {}, 0
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {}
        for n in names[s * per_shard : (s + 1) * per_shard]:
            part[n] = (0.02 * torch.randn(shapes[n], generator=gen)).to(dtype)
            weight_map[n] = file
            total += part[n].numel() * part[n].element_size()
        save_file(part, str(path / file), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    return total


def read_through(path: Path) -> None:
    """Pull every file into the page cache."""
    for f in sorted(path.iterdir()):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def rss_anon_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Samples RssAnon of a process every millisecond while in the `with` block."""

    def __init__(self, pid: int | str = "self"):
        self.pid, self.peak, self.start = pid, 0, 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        self.start = self.peak = rss_anon_bytes(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes(self.pid))
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.start


def memcpy_seconds(dst: list[torch.Tensor], repeats: int = 3) -> float:
    """Best time to copy the same bytes from fresh-but-touched sources into `dst`."""
    src = [torch.empty_like(t).fill_(1) for t in dst]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return best
