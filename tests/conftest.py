"""Shared fixtures: tiny checkpoints, and GPU tests skipped without CUDA."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.checkpoints import write_checkpoint
from tests.support.serverproc import REPO_ROOT, ServerProc, running_server

# A meta-device model (the push's plan stage) makes torch create its inductor cache directory,
# /tmp/torchinductor_<user> by default: keep it in the repository's ignored pytest cache instead,
# for this process and the servers and CLI processes the tests start (they inherit os.environ).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".pytest_cache" / "torchinductor"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random HF Qwen3 checkpoint (float32, no tokenizer), written once per session."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def builtin_server() -> Iterator[ServerProc]:
    """One server on the built-in model for the whole session, weight routes on (for pauses)."""
    with running_server("--allow-weight-update", "--max-http-submit-many", "4") as srv:
        yield srv


@pytest.fixture(scope="session")
def http(builtin_server: ServerProc) -> Iterator[httpx.Client]:
    with builtin_server.client() as client:
        yield client
