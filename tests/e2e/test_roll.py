"""ROLL (alibaba/ROLL 8eb27cc2) against a real server: SglangHttpEngine's exact HTTP calls
(roll/distributed/strategy/sglang_strategy.py L418-516, httpx with no retries), replayed.

ROLL's module raises at import unless sglang is one of the versions it pins, and PyPI's `roll`
is another project, so the bodies are copied here with the file and line each comes from.
ROLL sends no pause, continue, session or weight_version: it aborts what runs, releases the
memory, and writes the weights into the released server.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

from tests.support.reference import hf_generate
from tests.support.serverproc import free_port
from tests.support.trainer_side import broadcast_bucket, hf_state, join_group, post, tensor_entry
from tests.support.weight_helpers import checkpoint_sha256, served_sums

pytestmark = pytest.mark.timeout(180)

PROMPT = [5, 3, 5, 8, 9]


@pytest.fixture(scope="module")
def ckpts(checkpoint) -> dict[str, Path]:
    return {"base": checkpoint(seed=51), "new": checkpoint(seed=52)}


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    return start_server("--allow-weight-update", "--model-path", str(ckpts["base"]))


def restore(url: str, path: Path) -> None:
    assert post(url, "/update_weights_from_disk", {"model_path": str(path)}).status_code == 200


def generate(url: str) -> list[int]:
    """RouterClient._preprocess_generate (roll/distributed/scheduler/router.py L554-605) greedy,
    read as postprocess_generate (sglang_strategy.py L596-642) reads it: a dict or a list, the
    top-level output_ids, logprobs [0], finish_reason a dict or a string."""
    body = {
        "rid": str(uuid.uuid4()),
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 100,
            "stop_token_ids": [0, 1],
            "repetition_penalty": 1.0,
            "n": 1,
            "stop": None,
            "no_stop_trim": True,
        },
        "return_logprob": True,
    }
    reply = post(url, "/generate", body)
    reply.raise_for_status()
    outputs = reply.json()
    outputs = outputs if isinstance(outputs, list) else [outputs]
    (out,) = outputs
    ids, logprobs = out["output_ids"], out["meta_info"]["output_token_logprobs"]
    assert len(ids) == len(logprobs) and all(isinstance(lp[0], float) for lp in logprobs)
    reason = out["meta_info"]["finish_reason"]
    assert (reason["type"] if isinstance(reason, dict) else reason) != "abort"
    return ids


def test_colocated_sync_sequence(srv, ckpts):
    """The sync RLVR pipeline (rlvr_pipeline.py L504-561): abort every in-flight rid on every
    worker, release all memory, resume the weights before the first bucket (_reload_model
    L347-354), one tensor call per bucket (update_parameter_in_bucket L336-345: no version, no
    selector), then load_states (L359-370): POST /flush_cache {} and resume the rest."""
    url, new = srv.url, ckpts["new"]
    restore(url, ckpts["base"])
    version = httpx.get(url + "/get_weight_version").json()["weight_version"]
    # router.py L740-753: each in-flight rid goes to every worker, known there or not.
    post(url, "/abort_request", {"rid": str(uuid.uuid4())}).raise_for_status()
    post(url, "/release_memory_occupation", {}).raise_for_status()  # offload_states
    post(url, "/resume_memory_occupation", {"tags": ["weights"]}).raise_for_status()
    named = hf_state(new)
    for i in range(0, len(named), 6):
        keep: list = []
        body = {
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "serialized_named_tensors": [tensor_entry(named[i : i + 6], keep)],
        }
        post(url, "/update_weights_from_tensor", body).raise_for_status()
    post(url, "/flush_cache", {}).raise_for_status()  # no retry: a 400 would fail at once
    tags = {"tags": ["kv_cache", "cuda_graph"]}
    post(url, "/resume_memory_occupation", tags).raise_for_status()
    assert served_sums(url) == checkpoint_sha256(new)
    assert generate(url) == hf_generate(new, PROMPT)
    assert httpx.get(url + "/get_weight_version").json()["weight_version"] == version


def test_separated_broadcast_sequence(srv, ckpts):
    """setup_collective_group (L318-328) and broadcast_parameter (L330-334): ROLL reads
    `success` and `message` of both replies (a missing key is a KeyError)."""
    url, new = srv.url, ckpts["new"]
    restore(url, ckpts["base"])
    init = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "group_name": "roll_model_update",
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",  # "nccl" in ROLL; gloo on the CPU
    }
    reply, pg = join_group(url, init)
    reply.raise_for_status()
    assert reply.json()["success"] is True and isinstance(reply.json()["message"], str)
    try:
        named = hf_state(new)
        for i in range(0, len(named), 10):
            bucket = named[i : i + 10]
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": "roll_model_update",
                "flush_cache": False,
            }
            out = broadcast_bucket(url, body, pg, [t for _, t in bucket]).json()
            assert out["success"] is True and isinstance(out["message"], str)
    finally:
        post(url, "/destroy_weights_update_group", {"group_name": "roll_model_update"})
        dist.destroy_process_group(pg)
    assert served_sums(url) == checkpoint_sha256(new)
    assert generate(url) == hf_generate(new, PROMPT)


def test_abort_all_and_unknown_rids_answer_200(srv):
    """abort_all_worker (router.py L755-758) and rids a worker never saw: 2xx on every worker."""
    url = srv.url
    assert post(url, "/abort_request", {"abort_all": True}).status_code == 200
    for _ in range(3):
        assert post(url, "/abort_request", {"rid": str(uuid.uuid4())}).status_code == 200
