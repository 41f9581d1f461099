"""miles (radixark/miles 31f1ca961) against a real server: its exact HTTP calls, replayed.

miles' client module (miles/backends/sglang_utils/sglang_engine.py, "the client" below) imports
sglang, ray and sglang_router at module level and is not on PyPI, so the bodies are copied here
with the file and line each comes from; the checksum reader is re-expressed from
miles/utils/audit_utils/checksum_utils.py (what it asserts and the keys it builds).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

from tests.support.reference import hf_generate
from tests.support.serverproc import assert_error, free_port
from tests.support.trainer_side import (
    broadcast_bucket,
    flush_loop,
    hf_state,
    join_group,
    post,
    tensor_entry,
)
from tests.support.weight_helpers import checkpoint_sha256, served_sums

pytestmark = pytest.mark.timeout(180)

PROMPT = [3, 1, 4, 1, 5]
# The client's _wait_server_healthy (L90-123): an external engine has api_key None.
EXTERNAL_HEADERS = {
    "Content-Type": "application/json; charset=utf-8",
    "Authorization": "Bearer None",
}


@pytest.fixture(scope="module")
def ckpts(checkpoint) -> dict[str, Path]:
    return {"base": checkpoint(seed=31), "new": checkpoint(seed=32)}


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    return start_server("--allow-weight-update", "--model-path", str(ckpts["base"]))


def restore(url: str, path: Path) -> None:
    body = {"model_path": str(path), "weight_version": "base"}
    assert post(url, "/update_weights_from_disk", body).status_code == 200


def greedy(url: str) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
    return post(url, "/generate", body).json()["output_ids"]


def check_weights(url: str, action: str, skip_list: list[str] | None = None) -> httpx.Response:
    """The client's check_weights (L534-541): skip_tensor_list only when a list is given."""
    payload = {"action": action, "allow_quant_error": False, "selector": "all"}
    if skip_list is not None:
        payload["skip_tensor_list"] = skip_list
    reply = post(url, "/weights_checker", payload)
    reply.json()  # _make_request (L271-292) parses every reply
    return reply


def miles_checksums(body: dict) -> dict[str, str]:
    """What checksum_utils reads of one engine's body: success, a non-empty `ranks`, one GPU
    rank across each rank's parallelism_info roles, checksums keyed rank{r}/{name}."""
    assert body.get("success", False)
    ranks = body.get("ranks", []) or []
    assert ranks
    merged = {}
    for rank_info in ranks:
        gpu_ranks = {role["rank"] for role in rank_info["parallelism_info"]}
        assert len(gpu_ranks) == 1
        (rank,) = gpu_ranks
        for name, value in rank_info["checksums"].items():
            merged[f"rank{rank}/{name}"] = value
    return merged


def test_external_engine_start_passes_the_field_check(srv, ckpts):
    """_init_external (L222-244): health, the flush loop, then GET /get_server_info, each field
    compared with == to what _compute_server_args (L696-819) computes for one GPU engine at
    127.0.0.1:<port> with miles' defaults (addr_allocator.py L115-126: port is an int)."""
    restore(srv.url, ckpts["base"])
    with httpx.Client(base_url=srv.url, headers=EXTERNAL_HEADERS, timeout=60) as c:
        assert c.get("/health_generate").status_code == 200
        assert c.get("/flush_cache").status_code == 200
        reply = c.get("/get_server_info")
        reply.raise_for_status()
        actual = reply.json()
        assert c.get("/server_info").json() == actual  # the P2P path's name (L362-368)
    expected = {
        "enable_memory_saver": False,
        "host": "127.0.0.1",
        "port": srv.port,
        "nnodes": 1,
        "node_rank": 0,
        "gpu_id_step": 1,
        "base_gpu_id": 0,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
    }
    for name, value in expected.items():
        assert actual.get(name) == value, (name, actual.get(name))
    # get_weight_version (L499-508) reads /model_info first; a 200 without the key is a KeyError.
    assert httpx.get(srv.url + "/model_info").json()["weight_version"] == "base"


def test_check_weight_update_equal_with_a_skip_list(srv, ckpts):
    """--check-weight-update-equal: snapshot, then reset_tensors with the skip list at start
    (placement_group.py L199-203), the first sync, then compare with it (train.py L54-60). A
    tensor the trainer never sends is in the skip list: reset must leave it alone, compare must
    not look at it; the rest must come back equal."""
    url, base = srv.url, ckpts["base"]
    restore(url, base)
    skip = ["embed_tokens"]
    assert check_weights(url, "snapshot").status_code == 200
    assert check_weights(url, "reset_tensors", skip).status_code == 200
    # The sync sends everything but the skipped tensor (the tensor path's body, without a
    # weight_version: a label on all but one tensor would leave the weights mixed).
    named = [(n, t) for n, t in hf_state(base) if "embed_tokens" not in n]
    keep: list = []
    body = {
        "serialized_named_tensors": [tensor_entry(named, keep)],
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "selector": "all",
    }
    assert post(url, "/update_weights_from_tensor", body).json()["success"] is True
    assert check_weights(url, "compare", skip).status_code == 200
    assert check_weights(url, "compare").status_code == 200  # the skipped tensor was not reset
    assert served_sums(url) == checkpoint_sha256(base)
    assert greedy(url) == hf_generate(base, PROMPT)
    # compare skips what it is told to: one tensor of another checkpoint differs.
    assert check_weights(url, "snapshot").status_code == 200
    norm = [(n, t) for n, t in hf_state(ckpts["new"]) if n == "model.norm.weight"]
    body["serialized_named_tensors"] = [tensor_entry(norm, keep)]
    assert post(url, "/update_weights_from_tensor", body).status_code == 200
    assert check_weights(url, "compare", ["model.norm."]).status_code == 200
    refused = check_weights(url, "compare")
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert "norm.weight" in refused.json()["message"]


def test_checksum_reads_as_checksum_utils_reads_it(srv, ckpts):
    """The checksum miles asks for after every update (miles/ray/train/group.py L269-282)."""
    url, base = srv.url, ckpts["base"]
    restore(url, base)
    body = check_weights(url, "checksum").json()
    sums = miles_checksums(body)
    want = checkpoint_sha256(base)  # transformers' tensors, hashed here
    assert sums == {f"rank0/{name}": digest for name, digest in want.items()}
    (rank,) = body["ranks"]
    h = hashlib.sha256()
    for name in sorted(rank["checksums"]):
        h.update(name.encode() + rank["checksums"][name].encode())
    assert rank["per_gpu_checksum"] == h.hexdigest()
    assert body["per_engine_checksum"] == hashlib.sha256(h.hexdigest().encode()).hexdigest()
    assert {n: t["sha256"] for n, t in body["tensors"].items()} == want  # grctl's own shape
    # SGLang 0.5.23's default action is checksum, on GET too; skip_tensor_list leaves names out.
    assert miles_checksums(post(url, "/weights_checker", {}).json()) == sums
    assert miles_checksums(httpx.get(url + "/weights_checker").json()) == sums
    skipped = miles_checksums(check_weights(url, "checksum", ["layers.1.", "lm_head"]).json())
    assert set(skipped) == {k for k in sums if "layers.1." not in k and "lm_head" not in k}


def test_tensor_sync_sequence(srv, ckpts):
    """update_weight_from_tensor.py UpdateWeightFromTensor.update_weights (L237-321)."""
    url, new = srv.url, ckpts["new"]
    restore(url, ckpts["base"])
    post(url, "/pause_generation", {"mode": "retract"}).raise_for_status()  # L623-629
    flush_loop(url)  # L445-463, sent even for in_place on this path (L258)
    assert post(url, "/begin_weight_update", {"selector": "all"}).json()["success"] is True
    named = hf_state(new)
    for i in range(0, len(named), 7):  # one call per bucket (L450-545)
        keep: list = []
        body = {
            "serialized_named_tensors": [tensor_entry(named[i : i + 7], keep)],
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "selector": "all",
            "weight_version": "7",
        }
        reply = post(url, "/update_weights_from_tensor", body).json()
        assert reply.get("success") is not False, reply  # _check_weight_sync_results
    assert post(url, "/end_weight_update", {}).json()["success"] is True
    continued = post(url, "/continue_generation", {})
    continued.raise_for_status()
    continued.json()
    assert httpx.get(url + "/model_info").json()["weight_version"] == "7"
    assert served_sums(url) == checkpoint_sha256(new)
    assert greedy(url) == hf_generate(new, PROMPT)


def test_broadcast_sync_sequence(srv, ckpts):
    """--update-weight-transfer-mode broadcast: group setup (broadcast.py L63-92, L201-244),
    then the sync (mixin.py L309-331, broadcast.py L259-291, the client L598-648)."""
    url, new = srv.url, ckpts["new"]
    restore(url, ckpts["base"])
    post(url, "/destroy_weights_update_group", {"group_name": "miles-pp_0"})  # errors swallowed
    init = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),  # an int, unlike AReaL
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "miles-pp_0",
        "backend": "gloo",  # "nccl" in miles; gloo on the CPU
    }
    reply, pg = join_group(url, init)
    assert reply.status_code == 200, reply.text
    try:
        post(url, "/pause_generation", {"mode": "retract"}).raise_for_status()
        flush_loop(url)  # skipped only for in_place (L315-316)
        post(url, "/begin_weight_update", {"selector": "all"}).raise_for_status()
        named = hf_state(new)
        for i in range(0, len(named), 9):
            bucket = named[i : i + 9]
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": "miles-pp_0",
                "flush_cache": False,
                "selector": "all",
                "weight_version": "7",
            }
            broadcast_bucket(url, body, pg, [t for _, t in bucket]).json()
        version = {"new_version": "7", "abort_all_requests": False}  # the client L644-648
        post(url, "/update_weight_version", version).raise_for_status()
        post(url, "/end_weight_update", {}).raise_for_status()
        post(url, "/continue_generation", {}).raise_for_status()
    finally:
        post(url, "/destroy_weights_update_group", {"group_name": "miles-pp_0"})
        dist.destroy_process_group(pg)
    assert httpx.get(url + "/get_weight_version").json()["weight_version"] == "7"
    assert served_sums(url) == checkpoint_sha256(new)
    assert greedy(url) == hf_generate(new, PROMPT)


def test_rollout_generate_and_abort(srv, ckpts):
    """generate_endpoint_utils.py L52-112 and update_sample_from_response: text, the logprob
    pairs ([1] the token, [0] the logprob), finish_reason.type, weight_version; the abort of
    sglang_rollout.py L399-412."""
    restore(srv.url, ckpts["base"])
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop": None,
            "stop_token_ids": None,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "max_new_tokens": 4,
        },
        "return_logprob": True,
        "return_routed_experts": False,
        "return_indexer_topk": False,
    }
    out = post(srv.url, "/generate", body).json()
    pairs = out["meta_info"]["output_token_logprobs"]
    assert [p[1] for p in pairs] == out["output_ids"] and all(p[0] <= 0 for p in pairs)
    assert isinstance(out["text"], str) and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["weight_version"] == "base"
    assert post(srv.url, "/abort_request", {"abort_all": True}).status_code == 200


def test_p2p_lora_and_a_local_checkpoint_pull_are_refused_naming_what_to_use(srv):
    """Transports grctl lacks answer 501 with a JSON body that says what works instead."""
    url = srv.url
    # P2P (p2p_transfer_utils.py L215-238): the RDMA session, then the rank's layout.
    p2p = httpx.get(url + "/get_remote_instance_transfer_engine_info", params={"rank": 0})
    err = assert_error(p2p, 501, "not_supported")
    assert "/update_weights_from_distributed" in err["message"] and p2p.json()["success"] is False
    layout = httpx.get(url + "/parallelism_config", params={"rank": 0}).json()
    assert layout["tp_size"] == layout["pp_size"] == layout["world_size"] == 1
    assert layout["tp_rank"] == layout["global_rank"] == layout["local_rank"] == 0
    assert_error(
        httpx.get(url + "/parallelism_config", params={"rank": 1}), 400, "validation_error"
    )
    # LoRA over tensors (update_weight_from_tensor.py L509-545): unload first, then load.
    unload = post(url, "/unload_lora_adapter", {"lora_name": "miles_lora"})
    assert "merge the adapter" in assert_error(unload, 501, "not_supported")["message"]
    lora = {
        "lora_name": "miles_lora",
        "config_dict": {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": []},
        "pinned": False,
        "serialized_named_tensors": ["x"],
    }
    assert_error(post(url, "/load_lora_adapter_from_tensors", lora), 501, "not_supported")
    # disk-delta (delta.py L127-168) pulls into a host-local checkpoint it seeded first
    # (tests/e2e/test_miles_delta.py replays the flow): a pull into an unseeded one says so.
    pull = {"local_checkpoint_dir": "/nonexistent-x", "source_dir": "/y", "target_version": 1}
    err = assert_error(post(url, "/pull_weights", pull), 409, "conflict")
    assert "no seeded checkpoint" in err["message"]
    # A route nobody serves is a 404 whatever the method (POST answered 405 before).
    assert_error(post(url, "/no_such_route", {}), 404, "not_found")
    assert_error(httpx.get(url + "/no_such_route"), 404, "not_found")
