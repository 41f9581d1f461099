"""Fixtures every directory shares: tiny checkpoints, the server factories, GPU tests skipped
without CUDA.

A module that serves sets its own `srv` (start_server for a real `grctl serve`, start_app for
the app in this process); `http` is then a client of it. tests/server/conftest.py adds the
session's built-in-model servers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.appserver import AppServer, app_server
from tests.support.checkpoints import write_checkpoint, write_word_tokenizer
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
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint(seed=0, tokenizer=False, **write_checkpoint's keywords) -> a tiny random HF
    Qwen3 directory, written once per session for each set of arguments and shared: a test
    that changes files in it copies it first. tokenizer: add write_word_tokenizer's."""
    written: dict[tuple, Path] = {}

    def make(seed: int = 0, tokenizer: bool = False, **kw) -> Path:
        key = (seed, tokenizer, *sorted((k, str(v)) for k, v in kw.items()))
        if key not in written:
            path = write_checkpoint(tmp_path_factory.mktemp(f"ckpt-seed{seed}"), seed=seed, **kw)
            if tokenizer:
                write_word_tokenizer(path)
            written[key] = path
        return written[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint: Callable[..., Path]) -> Path:
    """The tiny checkpoint of seed 0 (float32, no tokenizer)."""
    return checkpoint(seed=0)


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., ServerProc]]:
    """start_server(*flags, env=None) -> a real `grctl serve` (tests/support/serverproc.py),
    stopped when the module's tests are done."""
    with ExitStack() as stack:
        yield lambda *flags, **kw: stack.enter_context(running_server(*flags, **kw))


@pytest.fixture(scope="module")
def start_app() -> Iterator[Callable[..., AppServer]]:
    """start_app(*flags, env=None) -> the app in this process (tests/support/appserver.py),
    stopped when the module's tests are done."""
    with ExitStack() as stack:
        yield lambda *flags, **kw: stack.enter_context(app_server(*flags, **kw))


@pytest.fixture(scope="module")
def http(srv: ServerProc | AppServer) -> Iterator[httpx.Client]:
    """A client of the module's `srv`, a real server or the app in this process."""
    with srv.client(timeout=120) as client:
        yield client
