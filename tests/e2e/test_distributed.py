"""Weight broadcast over torch.distributed (gloo): this test process is the trainer, rank 0, and
real `grctl serve` subprocesses are the other ranks."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from subprocess import PIPE
from unittest.mock import ANY

import httpx
import pytest
import torch
import torch.distributed as dist

from grctl.client.distributed import WeightBroadcaster, buckets
from grctl.errors import ValidationError
from grctl.weights.apply import TensorSpec
from grctl.weights.checker import tensor_sha256
from grctl.weights.distributed import byte_layout, parse_specs, split_bucket, wait_all
from tests.support.checkpoints import load_hf
from tests.support.reference import hf_generate
from tests.support.serverproc import REPO_ROOT, assert_error, free_port, running_server

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 4  # GR_DIST_TIMEOUT_S of the servers: the receive timeout the tests wait out
ENV = {"GR_DIST_TIMEOUT_S": str(TIMEOUT_S)}
PROMPT, MAX_NEW = [3, 1, 4, 1, 5], 5
THREADS = ThreadPoolExecutor(4)  # for HTTP calls that must be in flight while the test acts


@pytest.fixture(scope="module")
def ckpts(checkpoint) -> dict[str, Path]:
    out = {f"seed{s}": checkpoint(seed=s) for s in (0, 1, 2)}
    for s in (3, 4):
        out[f"tied{s}"] = checkpoint(seed=s, tie_word_embeddings=True)
    return out


@pytest.fixture(scope="module")
def urls(start_server, ckpts) -> list[str]:
    args = ("--allow-weight-update", "--model-path", str(ckpts["seed0"]))
    return [start_server(*args, env=ENV).url for _ in range(2)]


def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body or {}, timeout=60)


def checksums(url: str) -> dict[str, str]:
    tensors = post(url, "/weights_checker", {"action": "checksum"}).json()["tensors"]
    return {name: t["sha256"] for name, t in tensors.items()}


def expected_sums(sent: dict[str, torch.Tensor], served: dict[str, str]) -> dict[str, str]:
    """What a float32 server must report: each tensor as sent, converted to float32."""
    return {name: tensor_sha256(sent[name].float()) for name in served}


def greedy(url: str) -> list[int]:
    sp = {"max_new_tokens": MAX_NEW, "ignore_eos": True}
    return post(url, "/generate", {"input_ids": PROMPT, "sampling_params": sp}).json()["output_ids"]


def destroy(url: str, group_name: str) -> httpx.Response:
    return post(url, "/destroy_weights_update_group", {"group_name": group_name})


# ---- units ----------------------------------------------------------------------------------


class NcclLikeWork:
    """A collective as NCCL's Work reports it: wait() only orders streams and returns at once;
    is_completed() turns true when the transfer has really ended (`done_at`, None: never)."""

    def __init__(self, done_at: float | None):
        self.done_at = done_at
        self.num_waits = 0

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout=None) -> bool:
        self.num_waits += 1
        return True


def test_receive_waits_for_completion_not_for_wait():
    never = NcclLikeWork(None)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        wait_all([NcclLikeWork(t0), never], timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2 and never.num_waits == 0
    late = NcclLikeWork(time.monotonic() + 0.2)
    wait_all([late], timeout=5)
    assert late.is_completed() and late.num_waits == 1  # wait() after: raises a failure


def test_specs_are_validated_before_anything_else():
    specs = parse_specs(["a", "b"], ["torch.bfloat16", "float32"], [[2, 3], []])
    assert [s.dtype for s in specs] == [torch.bfloat16, torch.float32]
    for names, dtypes, shapes, words in [
        (["a"], ["bfloat17"], [[1]], "unknown dtype"),
        (["a"], ["float32"], [[2, -1]], "negative"),
        (["a", "b"], ["float32"], [[1], [1]], "differ in length"),
    ]:
        with pytest.raises(ValidationError, match=words):
            parse_specs(names, dtypes, shapes)


def test_flattened_bucket_splits_by_byte_layout():
    tensors = [torch.randn(3).to(torch.bfloat16), torch.randn(2, 2), torch.randn(0), torch.ones(1)]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    specs = [TensorSpec(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    assert byte_layout(specs) == [(0, 6), (6, 22), (22, 22), (22, 26)]
    for got, want in zip(split_bucket(flat, specs), tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)  # t1 sits at an odd offset


def test_buckets_flag_the_last_and_keep_order():
    named = [(str(i), torch.zeros(n)) for i, n in enumerate([4, 4, 10, 1, 1])]
    got = [([n for n, _ in b], last) for b, last in buckets(named, bucket_bytes=32)]
    assert got == [(["0", "1"], False), (["2"], False), (["3", "4"], True)]
    assert list(buckets([], 32)) == []


# ---- against real servers -------------------------------------------------------------------


@pytest.mark.parametrize(
    "load_format, seed, dtype", [("flattened_bucket", 1, None), (None, 2, torch.bfloat16)]
)
def test_full_broadcast_to_two_servers(urls, ckpts, load_format, seed, dtype):
    hf = load_hf(ckpts[f"seed{seed}"])
    state = {k: (v.to(dtype) if dtype else v) for k, v in hf.state_dict().items()}
    with WeightBroadcaster(urls, load_format=load_format, bucket_bytes=100_000) as wb:
        stats = wb.send(state.items(), weight_version=f"seed{seed}")
        assert stats["buckets"] > 1 and stats["tensors"] == len(state)
        for url in urls:  # destroy answers 200 on every server
            assert destroy(url, wb.name).json() == {"success": True, "message": ANY}
        dist.destroy_process_group(wb.pg)
        wb.pg = None
    if dtype:  # the reference generates from the same bf16-rounded weights the servers got
        hf.to(dtype).float()
    want = hf_generate(hf, PROMPT, MAX_NEW)
    for url in urls:
        served = checksums(url)
        assert served == expected_sums(state, served)
        assert greedy(url) == want
        assert httpx.get(url + "/get_weight_version").json()["weight_version"] == f"seed{seed}"


def test_a_partial_broadcast_leaves_the_weights_mixed_until_the_rest_arrives(urls, ckpts):
    """Each broadcast bucket labels the tensors it wrote: half a model under a new label is a
    mix the server refuses to serve; the whole model under it serves again."""
    url, hf = urls[0], load_hf(ckpts["seed1"])
    state = hf.state_dict()
    part = [(n, t) for n, t in state.items() if n.startswith("model.layers.0.")]
    with WeightBroadcaster([url], bucket_bytes=100_000) as wb:
        wb.send(part, weight_version="part")
        v = httpx.get(url + "/get_weight_version").json()
        assert v["weights_mixed"] and v["label_counts"]["part"] == len(part)
        sp = {"max_new_tokens": MAX_NEW}
        assert_error(post(url, "/generate", {"input_ids": PROMPT, "sampling_params": sp}), 503,
                     "weights_mixed")  # fmt: skip
        wb.send(state.items(), weight_version="whole")
    v = httpx.get(url + "/get_weight_version").json()
    assert not v["weights_mixed"] and list(v["label_counts"]) == ["whole"]
    assert greedy(url) == hf_generate(hf, PROMPT, MAX_NEW)


def test_tied_embeddings_stay_tied(ckpts):
    hf = load_hf(ckpts["tied4"])
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # as SGLang's test
    args = ("--allow-weight-update", "--model-path", str(ckpts["tied3"]))
    with running_server(*args, env=ENV) as srv:
        with WeightBroadcaster([srv.url], timeout_s=30) as wb:
            wb.send(state.items())
        served = checksums(srv.url)
        embed = state["model.embed_tokens.weight"]
        assert served == expected_sums({**state, "lm_head.weight": embed}, served)
        lm_head, embed_view = (
            post(srv.url, "/get_weights_by_name", {"name": n}).json()
            for n in ("lm_head.weight", "model.embed_tokens.weight")
        )
        assert lm_head == embed_view
        assert greedy(srv.url) == hf_generate(hf, PROMPT, MAX_NEW)


def test_invalid_requests_are_refused_without_joining(urls, ckpts):
    url, state = urls[0], load_hf(ckpts["seed1"]).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    good = {"names": [name], "dtypes": ["float32"], "shapes": [list(state[name].shape)]}
    with WeightBroadcaster(urls, timeout_s=TIMEOUT_S) as wb:
        good["group_name"] = wb.name
        for bad in [  # a description no trainer could broadcast, or no group to receive in
            {"dtypes": ["bfloat17"]},
            {"shapes": [[-1, 64]]},
            {"group_name": "no_such_group"},
            {"load_format": "direct"},
        ]:
            t0 = time.monotonic()
            reply = post(url, "/update_weights_from_distributed", {**good, **bad})
            assert time.monotonic() - t0 < TIMEOUT_S - 1, bad  # a joined receive waits TIMEOUT_S
            assert_error(reply, 400, "validation_error")
            assert reply.json()["success"] is False, bad
        # The collective sequence is intact: a real update still lines up on both servers.
        wb.send(state.items())
        assert checksums(url) == expected_sums(state, checksums(url))
        # Our own broadcaster, refused: it fails at once, and the group is broken for good.
        t0 = time.monotonic()
        with pytest.raises(ValidationError, match="unknown tensor"):
            wb.send([("model.layers.9.mlp.up_proj.weight", torch.zeros(96, 64))])
        assert wb.is_broken and time.monotonic() - t0 < TIMEOUT_S - 1
    assert time.monotonic() - t0 < TIMEOUT_S - 1  # close() did not wait for the lost broadcast
    assert_error(destroy(url, wb.name), 400, "validation_error")  # destroyed by close()


def update_beside_its_broadcast(wb, url: str, body: dict, tensors: list) -> httpx.Response:
    """One update call and its broadcast, as a trainer makes them; the broadcast must end (the
    server received it) within the receive timeout."""
    call = THREADS.submit(post, url, "/update_weights_from_distributed", body)
    works = [dist.broadcast(t, 0, group=wb.pg, async_op=True) for t in tensors]
    reply = call.result(TIMEOUT_S + 10)
    wait_all(works, TIMEOUT_S)  # TimeoutError: the server left the broadcast unmatched
    return reply


def test_a_refused_update_still_drains_the_broadcast(urls, ckpts):
    """As SGLang: an update the model refuses (an unknown name, a shape that does not fit, a
    name sent twice, the weights released) receives the trainer's broadcast into scratch, then
    answers the refusal, so the trainer never hangs and the group's collective sequence stays in
    step."""
    url, state = urls[0], load_hf(ckpts["seed2"]).state_dict()
    before = checksums(url)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    unknown = ("model.layers.9.mlp.up_proj.weight", torch.randn(96, 64))
    wrong = (q, torch.randn(1, 64))
    with WeightBroadcaster([url], timeout_s=TIMEOUT_S) as wb:
        for load_format in (None, "flattened_bucket"):
            for named in ([unknown], [(k, state[k]), wrong], [(k, state[k]), (k, state[k])]):
                names = [n for n, _ in named]
                tensors = [t.contiguous() for _, t in named]
                body = {"names": names, "dtypes": ["float32"] * len(names),
                        "shapes": [list(t.shape) for t in tensors], "group_name": wb.name,
                        "load_format": load_format, "weight_version": "refused"}  # fmt: skip
                if load_format == "flattened_bucket":
                    tensors = [torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])]
                reply = update_beside_its_broadcast(wb, url, body, tensors)
                assert_error(reply, 400, "validation_error")
                assert reply.json()["success"] is False
        assert checksums(url) == before  # nothing written by the refusals
        released = post(url, "/release_memory_occupation", {"tags": ["weights"]})
        assert released.status_code == 200, released.text
        body = {"names": [q], "dtypes": ["float32"], "shapes": [list(state[q].shape)],
                "group_name": wb.name}  # fmt: skip
        reply = update_beside_its_broadcast(wb, url, body, [state[q].contiguous()])
        assert_error(reply, 503, "memory_released")
        assert post(url, "/resume_memory_occupation", {"tags": None}).status_code == 200
        version = httpx.get(url + "/get_weight_version").json()
        assert version["weight_version"] != "refused"
        # released without a host copy (the default): back as zeros until the send below
        assert version["discarded_tensors"] and not version["torn_tensors"]
        wb.send(state.items(), weight_version="seed2")  # still in step: it lines up
    assert checksums(url) == expected_sums(state, before)
    assert greedy(url) == hf_generate(load_hf(ckpts["seed2"]), PROMPT, MAX_NEW)


def test_an_update_refused_by_its_options_still_drains_the_broadcast(urls, ckpts):
    """A catalog_path the server refuses (403: catalog reloads are off; a path out of bounds
    is the same check) or a selector it does not serve (400) was refused by the route before
    the broadcast was received: the trainer's broadcast hung until the group timed out and
    the next update was a 500. Each is now answered after the broadcast is taken into
    scratch; nothing is written, and the group still lines up for the next update."""
    url, state = urls[1], load_hf(ckpts["seed1"]).state_dict()
    before = checksums(url)
    q = "model.layers.0.self_attn.q_proj.weight"
    with WeightBroadcaster([url], timeout_s=TIMEOUT_S) as wb:
        body = {"names": [q], "dtypes": ["float32"], "shapes": [list(state[q].shape)],
                "group_name": wb.name, "weight_version": "refused"}  # fmt: skip
        for extra, status, code in (
            ({"catalog_path": "/etc/passwd"}, 403, "route_disabled"),
            ({"catalog_path": ""}, 403, "route_disabled"),
            ({"selector": "draft"}, 400, "validation_error"),
        ):
            reply = update_beside_its_broadcast(wb, url, {**body, **extra}, [state[q].clone()])
            assert_error(reply, status, code)
            assert reply.json()["success"] is False
        assert checksums(url) == before  # nothing written
        assert httpx.get(url + "/get_weight_version").json()["weight_version"] != "refused"
        wb.send(state.items(), weight_version="seed1")  # still in step: it lines up
    assert checksums(url) == expected_sums(state, before)


def test_init_refuses_bad_args_and_times_out_without_a_trainer(urls):
    url = urls[0]

    def init(**kw) -> httpx.Response:
        body = {"master_address": "127.0.0.1", "master_port": str(free_port()), "world_size": 2}
        body.update({"rank_offset": 1, "group_name": "lonely", **kw})
        return post(url, "/init_weights_update_group", body)

    assert_error(init(rank_offset=0), 400, "validation_error")  # rank 0 is the trainer
    assert_error(init(backend="nccl"), 400, "validation_error")  # no CUDA here
    t0 = time.monotonic()
    call = THREADS.submit(init)
    time.sleep(0.5)
    assert_error(init(), 409, "conflict")  # the name is taken while it joins
    assert httpx.get(url + "/health", timeout=2).status_code == 200  # the event loop is free
    assert_error(call.result(TIMEOUT_S + 10), 500, "internal_error")
    assert TIMEOUT_S - 1 < time.monotonic() - t0 < TIMEOUT_S + 5
    assert_error(destroy(url, "lonely"), 400, "validation_error")  # nothing was left behind


TRAINER = """
import sys, time, torch, torch.distributed as dist
from safetensors.torch import load_file
from grctl.weights.process_group import create_group
port, ckpt = int(sys.argv[1]), sys.argv[2]
state = load_file(ckpt + "/model.safetensors")
print("ready", flush=True)  # imports done: the join below is quick
pg = create_group("gloo", "127.0.0.1", port, 2, 0, "weight_update_group", 30)
sys.stdin.readline()  # the test says go once the server's update call is in flight
stop_at = len(state) // 2 if sys.argv[3] == "half" else int(sys.argv[3])
for i, name in enumerate(sorted(state)):
    if i == stop_at:  # sends nothing more: the test kills it, or leaves it stalled
        print("half", flush=True)
        time.sleep(600)
    dist.broadcast(state[name].contiguous(), src=0, group=pg)
"""


@pytest.mark.parametrize("how, stop_at", [("killed", "half"), ("stalled", "half"), ("silent", "0")])
def test_trainer_that_dies_mid_broadcast(urls, ckpts, how, stop_at):
    """killed: the connection drops half-way; stalled: half sent, then nothing; silent: the
    trainer joins the group and never sends. Each fails the call within the receive timeout,
    with the weights unchanged."""
    url, new = urls[1], ckpts["seed2"]
    before, port = checksums(url), free_port()
    cmd = [sys.executable, "-c", TRAINER, str(port), str(new), stop_at]
    trainer = subprocess.Popen(cmd, stdin=PIPE, stdout=PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
        reply = post(url, "/init_weights_update_group", {**init, "world_size": 2})
        assert reply.status_code == 200, reply.text
        state = load_hf(new).state_dict()
        names = sorted(state)  # the trainer's order
        shapes = [list(state[n].shape) for n in names]
        body = {"names": names, "dtypes": ["float32"] * len(names), "shapes": shapes}
        call = THREADS.submit(post, url, "/update_weights_from_distributed", body)
        time.sleep(0.5)  # the server has posted its receives
        print("go", file=trainer.stdin, flush=True)
        assert trainer.stdout.readline().strip() == "half"
        t0 = time.monotonic()
        if how == "killed":
            trainer.kill()
        reply = call.result(TIMEOUT_S + 10)
        assert time.monotonic() - t0 < TIMEOUT_S + 5
        assert_error(reply, 500, "internal_error")
        assert "unchanged" in reply.json()["error"]["message"]
    finally:
        trainer.kill()
        trainer.wait()
    assert checksums(url) == before  # unchanged, and still served
    assert httpx.get(url + "/health").json() == {"ok": True}
    assert httpx.get(url + "/ready").status_code == 200 and len(greedy(url)) == MAX_NEW
    # The broken group was dropped on the server: the same name joins again and updates work.
    with WeightBroadcaster([url], timeout_s=30) as wb:
        wb.send(state.items())
    assert checksums(url) == expected_sums(state, before)
