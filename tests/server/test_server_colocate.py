"""What verl's colocated SGLang rollout sends: release and resume memory around a weight push
(a real server), batch /generate, and its delta load_format refused with the fix (in process,
Litestar's test client).

Every generated sequence is checked against transformers' greedy output on the checkpoint the
server should be serving at that point.
"""

from __future__ import annotations

import pytest
import torch

from grctl.client import GRClient, WeightSync
from grctl.errors import MemoryReleased
from tests.support.appserver import app_server
from tests.support.checkpoints import load_hf
from tests.support.reference import hf_generate
from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(240)
PROMPTS = [[1, 5, 9, 42, 7], [3, 3, 100], [64, 2, 8, 11, 90, 4, 4]]
VERL_DELTA = "verl.checkpoint_engine.delta_sync.sglang_loader.apply_delta"


@pytest.fixture(scope="module")
def ckpts(checkpoint):
    return checkpoint(seed=0), checkpoint(seed=1)


FLAGS = ("--allow-weight-update", "--enable-memory-saver", "--enable-prefill-cache")


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    return start_server("--model-path", str(ckpts[0]), *FLAGS)


@pytest.fixture(scope="module")
def app(start_app, ckpts):
    return start_app("--model-path", str(ckpts[0]), *FLAGS)


def generate(http, prompt, new_tokens: int = 4):
    return http.post(
        "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens}}
    )


def test_batch_generate_answers_each_prompt_in_order(app, ckpts):
    hf = load_hf(ckpts[0])
    with app.client() as http:
        body = {
            "input_ids": PROMPTS,
            "rid": ["a", "b", "c"],
            "sampling_params": [{"max_new_tokens": n} for n in (2, 4, 3)],
        }
        replies = http.post("/generate", json=body).json()
        assert [r["meta_info"]["id"] for r in replies] == ["a", "b", "c"]
        for reply, prompt, n in zip(replies, PROMPTS, (2, 4, 3), strict=True):
            assert reply["output_ids"] == hf_generate(hf, prompt, n)
        one_for_all = http.post(
            "/generate", json={"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 3}}
        ).json()
        assert [r["output_ids"] for r in one_for_all] == [hf_generate(hf, p, 3) for p in PROMPTS]
        assert_error(
            http.post("/generate", json={"input_ids": PROMPTS[:2], "rid": ["x", "x"]}),
            409,
            "duplicate_request_id",
        )
        assert_error(http.post("/submit", json={"input_ids": PROMPTS}), 400, "validation_error")
        (load,) = http.get("/v1/loads").json()["loads"]
        assert load["num_running_reqs"] + load["num_waiting_reqs"] == 0  # nothing left queued


def test_verl_colocate_cycle(srv, ckpts):
    """release [kv_cache, weights] -> resume [weights] -> push -> flush -> resume [kv_cache]."""
    hf0, hf1 = load_hf(ckpts[0]), load_hf(ckpts[1])
    with srv.client() as http:
        assert http.get("/server_info").json()["enable_memory_saver"] is True
        assert generate(http, PROMPTS[0]).json()["output_ids"] == hf_generate(hf0, PROMPTS[0], 4)
        resp = http.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
        assert resp.status_code == 200 and resp.json()["released"] == ["kv_cache", "weights"]
        err = assert_error(generate(http, PROMPTS[0]), 503, "memory_released")
        assert err["retryable"] and "kv_cache, weights" in err["message"]
        assert http.get("/ready").json()["reasons"] == ["memory_released"]
        assert_error(
            http.post("/get_weights_by_name", json={"name": "lm_head.weight"}),
            503,
            "memory_released",
        )
        disk = {"model_path": str(ckpts[1]), "abort_all_requests": True}
        assert_error(http.post("/update_weights_from_disk", json=disk), 503, "memory_released")

        resp = http.post("/resume_memory_occupation", json={"tags": ["weights"]})
        assert resp.json()["released"] == ["kv_cache"]
        with WeightSync(srv.url, bucket_mb=0.01, verify=True) as sync:
            assert sync.run(ckpts[1], weight_version="1").ok
        assert http.get("/flush_cache").status_code == 200
        assert_error(generate(http, PROMPTS[1]), 503, "memory_released")  # KV is still out

        resp = http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
        assert resp.json()["released"] == []
        for prompt in PROMPTS:
            reply = generate(http, prompt).json()
            assert reply["output_ids"] == hf_generate(hf1, prompt, 4)
            assert reply["meta_info"]["weight_version"] == "1"
        # GET without a body (SGLang takes both) releases and resumes every tag.
        assert http.get("/release_memory_occupation").json()["released"] == [
            "cuda_graph",
            "kv_cache",
            "weights",
        ]
        assert http.post("/resume_memory_occupation", json={"tags": None}).json()["released"] == []
        # no host copy by default (SGLang's enable_weights_cpu_backup=False): the weights came
        # back as no checkpoint, so nothing is served until the trainer pushes them again
        err = assert_error(generate(http, PROMPTS[2]), 503, "weights_discarded")
        assert "released without a host copy" in err["message"] and err["retryable"]
        assert http.get("/ready").json()["reasons"] == ["weights_discarded"]
        memory = http.get("/v1/loads", params={"include": "memory"}).json()["loads"][0]["memory"]
        assert memory["weight_host_backup_gb"] == 0.0 and memory["host_rss_gb"] > 0
        with WeightSync(srv.url, bucket_mb=0.01, verify=True) as sync:
            assert sync.run(ckpts[1], weight_version="1b").ok
        assert generate(http, PROMPTS[2]).json()["output_ids"] == hf_generate(hf1, PROMPTS[2], 4)


@pytest.mark.parametrize(
    "flags",
    [("--enable-weights-cpu-backup",), ("--preserve-parameter-names", "embed_tokens,norm")],
)
def test_a_release_keeps_a_host_copy_where_asked(start_server, ckpts, flags):
    """--enable-weights-cpu-backup keeps every parameter (served again at once after resume,
    equal to the checkpoint); --preserve-parameter-names keeps those named, the rest
    discarded and torn until pushed (vLLM's level-2 sleep with a keep-list)."""
    hf0 = load_hf(ckpts[0])
    srv = start_server("--model-path", str(ckpts[0]), *FLAGS, *flags)
    with srv.client() as http:
        assert http.post("/release_memory_occupation", json={"tags": ["weights"]}).json()[
            "released"
        ] == ["weights"]
        memory = http.get("/v1/loads", params={"include": "memory"}).json()["loads"][0]["memory"]
        assert memory["weight_gb"] == 0.0
        status = http.get("/status").json()["engine"]["memory"]
        kept, gone = status["offloaded_weight_bytes"], status["discarded_weight_bytes"]
        assert kept + gone == sum(t.numel() * t.element_size() for t in hf0.state_dict().values())
        assert (
            http.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["released"]
            == []
        )
        torn = http.get("/get_weight_version").json()["discarded_tensors"]
        if flags[0] == "--enable-weights-cpu-backup":
            assert torn == [] and gone == 0
            assert generate(http, PROMPTS[0]).json()["output_ids"] == hf_generate(
                hf0, PROMPTS[0], 4
            )
            return
        assert 0 < kept < gone
        assert torn and not any("embed_tokens" in n or n.endswith("norm.weight") for n in torn)
        assert any("mlp" in n for n in torn)
        assert_error(generate(http, PROMPTS[0]), 503, "weights_discarded")
        # the kept ones hold the checkpoint's bytes
        got = http.post(
            "/get_weights_by_name", json={"name": "model.embed_tokens.weight", "truncate_size": 3}
        )
        assert got.status_code == 200, got.text
        want = hf0.model.embed_tokens.weight.detach()[:3]
        assert torch.equal(torch.tensor(got.json()["parameter"], dtype=want.dtype), want)


def test_batch_of_texts(checkpoint):
    """text as a list is a batch too: each prompt tokenized, each reply decoded, in order."""
    model_dir = checkpoint(seed=0, tokenizer=True)  # a word tokenizer: "t5 t9" <-> [5, 9]
    hf = load_hf(model_dir)
    texts = [" ".join(f"t{i}" for i in p) for p in PROMPTS]
    with app_server("--model-path", str(model_dir)) as server, server.client() as http:
        body = {"text": texts, "sampling_params": {"max_new_tokens": 3}}
        replies = http.post("/generate", json=body).json()
    assert len(replies) == len(PROMPTS)
    for reply, prompt in zip(replies, PROMPTS, strict=True):
        want = hf_generate(hf, prompt, 3)
        assert reply["output_ids"] == want
        assert reply["text"] == " ".join(f"t{i}" for i in want)


def test_client_batch_and_memory_calls(srv, ckpts):
    with GRClient(srv.url) as gr:
        version = gr.get_weight_version().weight_version
        hf = load_hf(ckpts[0] if version == "default" else ckpts[1])
        replies = gr.generate_batch(
            PROMPTS, [{"max_new_tokens": n} for n in (1, 2, 3)], rid=["p", "q", "r"]
        )
        assert [r.meta_info.id for r in replies] == ["p", "q", "r"]
        for reply, prompt, n in zip(replies, PROMPTS, (1, 2, 3), strict=True):
            assert reply.output_ids == hf_generate(hf, prompt, n)
        assert gr.release_memory_occupation(["kv_cache"]).released == ["kv_cache"]
        with pytest.raises(MemoryReleased):
            gr.generate(PROMPTS[0], max_new_tokens=2)
        assert gr.resume_memory_occupation().released == []
        assert gr.server_info().enable_memory_saver is True


@pytest.mark.parametrize("tags", [["kv"], "weights", [3]])
def test_bad_tags_are_400_and_change_nothing(app, tags):
    with app.client() as http:
        resp = http.post("/release_memory_occupation", json={"tags": tags})
        assert_error(resp, 400, "validation_error")
        assert http.get("/ready").status_code == 200


def test_verl_delta_load_format_is_refused_with_what_to_send(app):
    with app.client() as http:
        body = {"serialized_named_tensors": ["AAAA"], "load_format": VERL_DELTA}
        err = assert_error(
            http.post("/update_weights_from_tensor", json=body), 400, "validation_error"
        )
        assert "flattened_bucket" in err["message"] and "direct" in err["message"]
        assert "delta" in err["message"]


def test_memory_routes_served_as_in_sglang_without_the_memory_saver(builtin_app):
    """As in SGLang, release/resume work whatever /server_info says of the memory saver (slime
    compares that flag with its own); like every weight route they need --allow-weight-update."""
    with builtin_app.client() as http:
        assert http.get("/server_info").json()["enable_memory_saver"] is False
        released = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert released.status_code == 200 and released.json()["released"] == ["kv_cache"]
        assert_error(http.post("/generate", json={"input_ids": [1, 2]}), 503, "memory_released")
        resumed = http.post("/resume_memory_occupation", json={"tags": None})
        assert resumed.status_code == 200 and resumed.json()["released"] == []
        assert http.post("/generate", json={"input_ids": [1, 2]}).status_code == 200
    with app_server() as plain, plain.client() as http:
        err = assert_error(http.post("/release_memory_occupation", json={}), 403, "route_disabled")
        assert "--allow-weight-update" in err["message"]
        assert http.get("/ready").status_code == 200  # nothing was released
