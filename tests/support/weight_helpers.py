"""Helpers for weight-sync tests: independent references for what a server should now serve."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import torch

from grctl.client import GRClient
from grctl.weights.checker import tensor_sha256
from tests.support.checkpoints import load_hf

PROMPTS = [[1, 2, 3, 4, 5], [17, 9], [40] * 11]


def served_greedy(client: httpx.Client, prompt: list[int], max_new_tokens: int = 4) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def served_by_client(url: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], str]:
    """GRClient's greedy generation on the server at `url`, and the weight version it names."""
    with GRClient(url) as gr:
        out = gr.generate(prompt, max_new_tokens=max_new_tokens)
    return out.output_ids, out.meta_info.weight_version


def checkpoint_sha256(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """sha256 of every tensor of the checkpoint, cast to the served dtype (via transformers)."""
    hf = load_hf(path)
    state = hf.state_dict()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {name: tensor_sha256(t.to(dtype)) for name, t in state.items()}


def served_sha256(client: httpx.Client) -> dict[str, str]:
    resp = client.post("/weights_checker", json={"action": "checksum"})
    assert resp.status_code == 200, resp.text
    return {name: v["sha256"] for name, v in resp.json()["tensors"].items()}


def served_sums(url: str) -> dict[str, str]:
    """served_sha256 of the server at `url`, on a client of its own."""
    with httpx.Client(base_url=url, timeout=60) as client:
        return served_sha256(client)


def flush_until_ok(client: httpx.Client, tries: int = 100, interval: float = 0.05) -> int:
    """slime's loop: GET /flush_cache until 200. Returns the number of 400s seen."""
    for attempt in range(tries):
        resp = client.get("/flush_cache")
        if resp.status_code == 200:
            return attempt
        assert resp.status_code == 400, resp.text
        time.sleep(interval)
    raise AssertionError("flush_cache never answered 200")
