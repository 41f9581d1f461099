"""AReaL (areal-project/AReaL cbff54d64) against a real server: its exact HTTP calls, replayed.

`areal.engine.sglang_remote` imports AReaL's whole stack (ray, torchdata, hydra, etcd3, ...) at
import time, so the bodies are copied here with the file and line each comes from. AReaL retries
every non-2xx on pause and disk calls (areal/infra/utils/http.py L128-218), reads no reply body
there, and keeps weight versions on its own side: the server's label stays as it was.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

from tests.support.reference import hf_generate
from tests.support.serverproc import free_port
from tests.support.trainer_side import broadcast_bucket, hf_state, join_group, post
from tests.support.weight_helpers import checkpoint_sha256, served_sums

pytestmark = pytest.mark.timeout(180)

PROMPT = [2, 7, 1, 8]
# build_generation_request (areal/engine/sglang_remote.py L54-102) for a greedy sample.
GENERATE = {
    "input_ids": PROMPT,
    "image_data": None,
    "sampling_params": {
        "top_p": 1.0,
        "top_k": 100000000,
        "max_new_tokens": 4,
        "temperature": 0.0,
        "stop_token_ids": [],
        "ignore_eos": False,
        "skip_special_tokens": True,
        "frequency_penalty": 0.0,
    },
    "return_logprob": True,
    "stream": False,
}


@pytest.fixture(scope="module")
def ckpts(checkpoint) -> dict[str, Path]:
    return {"base": checkpoint(seed=41), "new": checkpoint(seed=42)}


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    return start_server("--allow-weight-update", "--model-path", str(ckpts["base"]))


def restore(url: str, path: Path) -> None:
    assert post(url, "/update_weights_from_disk", {"model_path": str(path)}).status_code == 200


def generated(url: str) -> list[int]:
    """parse_generation_response (L104-140): a dict, finish_reason.type, the logprob pairs."""
    body = post(url, "/generate", GENERATE).json()
    assert isinstance(body, dict) and body["meta_info"]["finish_reason"]["type"] == "length"
    pairs = body["meta_info"]["output_token_logprobs"]
    assert all(isinstance(lp, float) for lp, _, _ in pairs)
    return [token for _, token, _ in pairs]


def pause_twice(url: str) -> list[httpx.Response]:
    """pause_generation (areal/infra/remote_inf_engine.py L1422-1436, get_pause_requests
    sglang_remote.py L344-364): two rounds, the default pause then in_place."""
    return [
        post(url, "/pause_generation", {}),
        post(url, "/pause_generation", {"mode": "in_place"}),
    ]


def test_disk_update_sequence(srv, ckpts):
    """_update_weights_from_disk (fsdp_engine.py L1695-1724, remote_inf_engine.py L1538-1594):
    the two pauses, the disk update with abort_all_requests and no version, then continue. A
    request in flight at the first pause ends as an abort (still a 200)."""
    url, new = srv.url, ckpts["new"]
    restore(url, ckpts["base"])
    version = httpx.get(url + "/get_weight_version").json()["weight_version"]
    long = {**GENERATE, "sampling_params": {**GENERATE["sampling_params"], "max_new_tokens": 64}}
    long["sampling_params"]["ignore_eos"] = True
    replies: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: replies.append(post(url, "/generate", long)))
    waiter.start()
    deadline = time.monotonic() + 30
    while httpx.get(url + "/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    first, second = pause_twice(url)
    waiter.join(60)
    assert first.status_code == second.status_code == 200
    assert first.json()["num_aborted_requests"] == 1 and second.json()["num_aborted_requests"] == 0
    assert replies[0].status_code == 200
    assert replies[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
    # build_disk_weight_update_requests (sglang_remote.py L176-225); sent again, as a retry would.
    body = {"model_path": str(new), "abort_all_requests": True}
    for _ in range(2):
        assert post(url, "/update_weights_from_disk", body).status_code == 200
    assert post(url, "/continue_generation", {}).status_code == 200
    assert served_sums(url) == checkpoint_sha256(new)
    assert generated(url) == hf_generate(new, PROMPT)
    assert httpx.get(url + "/get_weight_version").json()["weight_version"] == version


def test_distributed_update_sequence(srv, ckpts):
    """Group init (build_init_weights_group_request L255-337: master_port a string, pp_rank with a
    _<pp_rank> group name), the two pauses, one call per bucket with abort_all_requests and no
    flush_cache, version or session (fsdp_engine.py L1608-1692), then continue."""
    url, new = srv.url, ckpts["new"]
    restore(url, ckpts["base"])
    init = {
        "master_address": "127.0.0.1",
        "master_port": str(free_port()),
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",  # current_platform.communication_backend: "nccl" on CUDA
        "group_name": "update_weight_group_0",
        "pp_rank": 0,
    }
    reply, pg = join_group(url, init)
    assert reply.status_code == 200, reply.text
    try:
        assert [r.status_code for r in pause_twice(url)] == [200, 200]
        named = hf_state(new)
        for i in range(0, len(named), 8):
            bucket = named[i : i + 8]
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).split("torch.")[1] for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": "update_weight_group_0",
                "abort_all_requests": True,
            }
            broadcast_bucket(url, body, pg, [t for _, t in bucket])
        assert post(url, "/continue_generation", {}).status_code == 200
    finally:
        post(url, "/destroy_weights_update_group", {"group_name": "update_weight_group_0"})
        dist.destroy_process_group(pg)
    assert served_sums(url) == checkpoint_sha256(new)
    assert generated(url) == hf_generate(new, PROMPT)


def test_offload_onload_and_abort(srv, ckpts):
    """Offload (rl_trainer.py L548-578): the two pauses, then release; onload (L580-620):
    resume, then continue; abort_all_requests() (remote_inf_engine.py L1466-1469)."""
    url, base = srv.url, ckpts["base"]
    restore(url, base)
    assert [r.status_code for r in pause_twice(url)] == [200, 200]
    assert post(url, "/release_memory_occupation", {}).status_code == 200
    assert post(url, "/resume_memory_occupation", {}).status_code == 200
    assert post(url, "/continue_generation", {}).status_code == 200
    assert post(url, "/abort_request", {"abort_all": True}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # check_health (L510-520)
    # released without a host copy (SGLang's default): refused, never garbage, until the
    # trainer's weight update after onload writes them again
    refused = post(url, "/generate", GENERATE)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "weights_discarded"
    restore(url, base)
    assert generated(url) == hf_generate(base, PROMPT)
