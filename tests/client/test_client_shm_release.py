"""A push the server refuses before it unpickles anything (401, 403, 413, a refused or reset
connection) gives back the shared memory its payload lent: the segment leaves /dev/shm as soon
as the bucket is freed, not when the pushing process exits."""

from __future__ import annotations

import contextlib
import gc
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from grctl.client import buffers, staging
from grctl.client.http import GRClient
from grctl.client.outcome import ServerOutcome
from grctl.client.pipeline import PushOptions, Target, push_buckets
from grctl.weights.checkpoint import Checkpoint
from tests.support.checkpoints import write_checkpoint
from tests.support.serverproc import free_port, running_server

pytestmark = pytest.mark.timeout(180)


def my_segments() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith(f"torch_{os.getpid()}_")}


def push(url: str, ckpt: Checkpoint, **client_kw) -> ServerOutcome:
    plans = staging.plan_buckets(ckpt.specs(), torch.float32, 1 << 14)[:3]
    target = Target(GRClient(url, **client_kw), ServerOutcome(url))
    with ThreadPoolExecutor(2) as pool:
        push_buckets(ckpt, plans, torch.device("cpu"), [target], pool, PushOptions("r", None))
    target.client.close()
    return target.outcome


@pytest.mark.parametrize(
    "server_args, cases",
    [
        (("--api-key", "right"), {"needs an api key": {}, "wrong api key": {"api_key": "wrong"}}),
        (("--max-http-request-bytes", "300"), {"too large": {}}),
        (None, {"connection": {}}),  # nothing listens on the port: refused
    ],
)
def test_refused_pushes_release_their_segments(tmp_path, server_args, cases):
    ckpt = Checkpoint(write_checkpoint(tmp_path / "ckpt", seed=4))
    staging.shared_buffer(8)  # torch's shm manager starts once per process, not per push
    gc.collect()
    before = my_segments()
    with contextlib.ExitStack() as stack:
        url = f"http://127.0.0.1:{free_port()}"
        if server_args is not None:
            url = stack.enter_context(running_server("--allow-weight-update", *server_args)).url
        for case, client_kw in cases.items():
            outcome = push(url, ckpt, **client_kw)
            assert outcome.failed_stage == "push" and outcome.num_buckets == 0, outcome
            assert case in outcome.error.lower(), outcome.error
            buffers.release()  # the process's kept staging buffers: what is left is a leak
            gc.collect()
            assert my_segments() <= before, f"{case}: {sorted(my_segments() - before)}"
