"""The trainer's side of a weight sync, for tests that replay an RL framework's exact HTTP bodies
against a real server: this test process joins the gloo group as rank 0 beside the server's
blocking /init_weights_update_group, broadcasts beside each /update_weights_from_distributed,
and builds flattened_bucket payloads for /update_weights_from_tensor.

(gloo stands in for NCCL on the CPU: a body that names `"backend": "nccl"` is sent with "gloo".)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from grctl.weights.process_group import create_group
from grctl.weights.wire.encode import encode_bucket
from tests.support.checkpoints import load_hf

CALLS = ThreadPoolExecutor(4, thread_name_prefix="trainer-side")
TIMEOUT_S = 60


def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body if body is not None else {}, timeout=TIMEOUT_S)


def hf_state(path: Path) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors by HF name, as a trainer holds them."""
    return [(n, t.detach().clone()) for n, t in load_hf(path).state_dict().items()]


def join_group(url: str, body: dict) -> tuple[httpx.Response, dist.ProcessGroup]:
    """POST the framework's init body and join its group as rank 0 while the server waits."""
    call = CALLS.submit(post, url, "/init_weights_update_group", body)
    pg = create_group(
        "gloo",
        body["master_address"],
        int(body["master_port"]),
        int(body["world_size"]),
        0,
        body["group_name"],
        TIMEOUT_S,
    )
    return call.result(TIMEOUT_S), pg


def broadcast_bucket(
    url: str, body: dict, pg: dist.ProcessGroup, tensors: Iterable[torch.Tensor]
) -> httpx.Response:
    """POST one /update_weights_from_distributed body while broadcasting its tensors, in its
    names' order, as the trainer does after each call."""
    call = CALLS.submit(post, url, "/update_weights_from_distributed", body)
    works = [dist.broadcast(t.contiguous(), 0, group=pg, async_op=True) for t in tensors]
    reply = call.result(TIMEOUT_S)
    assert reply.status_code == 200, reply.text  # a refused call never receives: don't wait
    for w in works:
        w.wait()
    return reply


def tensor_entry(named: list[tuple[str, torch.Tensor]], keep_alive: list) -> str:
    """One serialized_named_tensors entry in SGLang's flattened_bucket form (shared memory on
    the CPU); `keep_alive` holds the bucket until the server has answered."""
    return encode_bucket(named, keep_alive=keep_alive)


def flush_loop(url: str, tries: int = 60) -> httpx.Response:
    """miles' and slime's flush: GET /flush_cache until 200, a pause between tries."""
    for _ in range(tries):
        reply = httpx.get(url + "/flush_cache", timeout=TIMEOUT_S)
        if reply.status_code == 200:
            return reply
        time.sleep(0.1)
    raise AssertionError(f"flush_cache never answered 200: {reply.text}")
