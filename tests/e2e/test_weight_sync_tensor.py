"""Weight sync part 2 on a real server: the tensor path (SGLang wire format over shared memory).

Pushes come from this test process or a separate client process; the server is its own process,
so every tensor really crosses processes through POSIX shared memory.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grctl.weights.wire.encode import (
    MultiprocessingSerializer,
    encode_bucket,
    encode_named_tensors,
)
from grctl.weights.wire.records import FlattenedTensorMetadata, LocalSerializedTensor
from tests.support import hostile_pickles
from tests.support.checkpoints import load_hf
from tests.support.reference import hf_generate
from tests.support.serverproc import REPO_ROOT, assert_error
from tests.support.weight_helpers import (
    PROMPTS,
    checkpoint_sha256,
    served_greedy,
    served_sha256,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ckpts(checkpoint) -> dict[str, Path]:
    return {"base": checkpoint(seed=21), "new": checkpoint(seed=22)}


@pytest.fixture(scope="module")
def srv(start_server, ckpts):
    return start_server("--allow-weight-update", "--model-path", str(ckpts["base"]))


def hf_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach().clone()) for n, t in load_hf(path).state_dict().items()]


def push(http, entry: str, load_format: str | None, **kw):
    body = {"serialized_named_tensors": [entry], "load_format": load_format, **kw}
    return http.post("/update_weights_from_tensor", json=body)


def restore(http, path: Path) -> None:
    resp = http.post(
        "/update_weights_from_disk", json={"model_path": str(path), "weight_version": "base"}
    )
    assert resp.status_code == 200, resp.text


SLIME_CLIENT = r"""
import json, sys, time, httpx, torch
from grctl.weights.wire.encode import encode_bucket
from tests.support.checkpoints import load_hf
url, path, num_chunks = sys.argv[1], sys.argv[2], int(sys.argv[3])
named = [(n, t.detach().clone()) for n, t in load_hf(path).state_dict().items()]
log = []
with httpx.Client(base_url=url, timeout=60) as c:
    log.append(c.post("/pause_generation", json={}).status_code)
    for _ in range(60):
        r = c.get("/flush_cache")
        if r.status_code == 200:
            break
        time.sleep(1)
    log.append(r.status_code)
    size = -(-len(named) // num_chunks)
    chunks = [named[i:i + size] for i in range(0, len(named), size)] + [[]]  # trailing empty
    for chunk in chunks:
        keep = []
        entry = encode_bucket(chunk, keep_alive=keep)
        r = c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [entry], "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": "7"})
        log.append(r.status_code)
        del keep  # the reply came: the server holds nothing of ours
    log.append(c.post("/continue_generation", json={}).status_code)
    log.append(c.get("/get_weight_version").json())
print(json.dumps(log))
"""


def run_client(script: str, *args: str) -> str:
    """Run a client process and read its output through a pipe. (A CPU sender starts torch's
    torch_shm_manager, which outlives it; grctl starts it detached from our stdout, else this
    pipe would never close.)"""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_slime_sequence_from_a_separate_process(http, srv, ckpts, tmp_path):
    restore(http, ckpts["base"])
    count = http.get("/get_weight_version").json()["weight_update_count"]
    out = run_client(SLIME_CLIENT, srv.url, str(ckpts["new"]), "4")
    log = json.loads(out.strip().splitlines()[-1])
    assert log[:2] == [200, 200] and log[2:-2] == [200] * 5 and log[-2] == 200
    assert log[-1]["weight_version"] == "7"
    assert log[-1]["weight_update_count"] == count + 5  # four chunks and the empty bucket
    assert served_sha256(http) == checkpoint_sha256(ckpts["new"])
    for p in PROMPTS:
        out = served_greedy(http, p)
        assert out["output_ids"] == hf_generate(ckpts["new"], p)
        assert out["meta_info"]["weight_version"] == "7"


def test_verl_shaped_payload(http, ckpts):
    restore(http, ckpts["base"])
    keep = []
    pairs = []
    for name, t in hf_tensors(ckpts["new"]):
        keep.append(t)
        inner = MultiprocessingSerializer.serialize(t)  # one entry per (trainer) TP rank
        pairs.append((name, LocalSerializedTensor(values=[inner])))
    entry = MultiprocessingSerializer.serialize(pairs, output_str=True)
    resp = push(http, entry, None, weight_version="verl-1")
    assert resp.status_code == 200, resp.text
    assert resp.json()["tensors_loaded"] == len(pairs)
    assert served_sha256(http) == checkpoint_sha256(ckpts["new"])


def test_plain_list_direct_and_dtype_conversion(http, ckpts):
    restore(http, ckpts["base"])
    new = dict(hf_tensors(ckpts["new"]))
    keep = []
    # null: HF names, sent in bfloat16 and converted to the served float32.
    chunk = [
        (n, new[n].to(torch.bfloat16))
        for n in ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight")
    ]
    assert push(http, encode_named_tensors(chunk, keep), None).status_code == 200
    got = http.get("/get_weights_by_name", params={"name": "model.norm.weight"}).json()
    assert torch.equal(torch.tensor(got["parameter"]), chunk[0][1].float())
    # direct: fused parameter names with exact shapes.
    p = "model.layers.1.mlp."
    fused = torch.cat([new[p + "gate_proj.weight"], new[p + "up_proj.weight"]])
    entry = encode_named_tensors([("layers.1.mlp.gate_up_proj.weight", fused)], keep)
    assert push(http, entry, "direct").status_code == 200
    got = http.get(
        "/get_weights_by_name", params={"name": p + "up_proj.weight", "truncate_size": 1000}
    ).json()
    assert torch.equal(torch.tensor(got["parameter"]), new[p + "up_proj.weight"])


def test_empty_bucket_and_empty_list_are_noops(http, ckpts):
    restore(http, ckpts["base"])
    sums = served_sha256(http)
    count = http.get("/get_weight_version").json()["weight_update_count"]
    empty_bucket = MultiprocessingSerializer.serialize(
        {"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": []}, output_str=True
    )
    for entry, fmt in ((empty_bucket, "flattened_bucket"), (encode_named_tensors([]), None)):
        resp = push(http, entry, fmt, flush_cache=False)
        assert resp.status_code == 200 and resp.json()["tensors_loaded"] == 0
    assert served_sha256(http) == sums
    assert http.get("/get_weight_version").json()["weight_update_count"] == count + 2


def test_chunk_applied_twice_and_buffer_reuse_after_reply(http, ckpts):
    restore(http, ckpts["base"])
    new = dict(hf_tensors(ckpts["new"]))
    name = "model.layers.1.self_attn.o_proj.weight"
    keep = []
    entry = encode_bucket([(name, new[name])], keep_alive=keep)
    assert push(http, entry, "flattened_bucket").status_code == 200
    sums = served_sha256(http)
    assert push(http, entry, "flattened_bucket").status_code == 200
    assert served_sha256(http) == sums
    keep[0].fill_(7)  # the client reuses its buffer: the server must hold no view of it
    assert served_sha256(http) == sums


def bad_bucket(records, flat_bytes: int = 64) -> str:
    flat = torch.zeros(flat_bytes, dtype=torch.uint8)
    return MultiprocessingSerializer.serialize(
        {"flattened_tensor": flat, "metadata": records}, output_str=True
    )


def meta(name, shape, start, end, dtype=torch.float32):
    return FlattenedTensorMetadata(
        name=name,
        shape=torch.Size(shape),
        dtype=dtype,
        start_idx=start,
        end_idx=end,
        numel=end - start,
    )


NORM = "model.norm.weight"


def refusals(hidden: int) -> dict[str, tuple[str, str | None]]:
    nb = hidden * 4
    keep = []
    return {
        "bad_base64": ("not base64!!", "flattened_bucket"),
        "not_a_pickle": (base64.b64encode(b"hello world").decode(), "flattened_bucket"),
        "wrong_shape": (bad_bucket([meta(NORM, [hidden - 1], 0, nb - 4)], nb), "flattened_bucket"),
        "unknown_name": (
            bad_bucket([meta("model.nope.weight", [hidden], 0, nb)], nb),
            "flattened_bucket",
        ),
        "out_of_range": (bad_bucket([meta(NORM, [hidden], 8, nb + 8)], nb), "flattened_bucket"),
        "overlapping": (
            bad_bucket(
                [
                    meta(NORM, [hidden], 0, nb),
                    meta("model.layers.0.input_layernorm.weight", [hidden], 4, nb + 4),
                ],
                nb + 4,
            ),
            "flattened_bucket",
        ),
        "negative_dim": (bad_bucket([meta(NORM, [-hidden], 0, nb)], nb), "flattened_bucket"),
        "fused_without_direct": (
            encode_named_tensors([("layers.0.mlp.gate_up_proj.weight", torch.zeros(4, 4))], keep),
            None,
        ),
        "split_with_direct": (
            encode_named_tensors([("model.layers.0.mlp.up_proj.weight", torch.zeros(4, 4))], keep),
            "direct",
        ),
        "unknown_format": (encode_named_tensors([(NORM, torch.zeros(hidden))], keep), "pt"),
        "int_tensor": (
            encode_named_tensors([(NORM, torch.zeros(hidden, dtype=torch.int32))], keep),
            None,
        ),
        "not_a_list": (MultiprocessingSerializer.serialize({"a": 1}, output_str=True), None),
    }


@pytest.mark.parametrize("case", list(refusals(64)))
def test_refusals_leave_weights_unchanged(http, ckpts, case):
    hidden = load_hf(ckpts["base"]).config.hidden_size
    entry, fmt = refusals(hidden)[case]
    sums = served_sha256(http)
    version = http.get("/get_weight_version").json()
    resp = push(http, entry, fmt, weight_version="should-not-stick")
    err = assert_error(resp, 400, "validation_error")
    assert resp.json()["success"] is False and err["message"]
    assert served_sha256(http) == sums
    assert http.get("/get_weight_version").json() == version


@pytest.mark.parametrize("builder", sorted(hostile_pickles.HOSTILE))
def test_hostile_pickles_never_run(http, tmp_path, builder):
    marker = tmp_path / "pwned"
    raw = hostile_pickles.HOSTILE[builder](marker)
    sums = served_sha256(http)
    for fmt in ("flattened_bucket", None):
        resp = push(http, base64.b64encode(raw).decode(), fmt)
        assert_error(resp, 400, "validation_error")
        assert not marker.exists(), f"{builder} ran on the server"
    assert served_sha256(http) == sums
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("name", sorted(hostile_pickles.MISUSE))
def test_allowlist_misuse_refused(http, name):
    raw = hostile_pickles.MISUSE[name]
    resp = push(http, base64.b64encode(raw).decode(), "flattened_bucket")
    assert_error(resp, 400, "validation_error")


def own_segments() -> set[str]:
    """This process's torch segments (torch names them torch_<pid>_...): the ones its pushes
    made, not those of other test runs sharing the machine's /dev/shm."""
    return {p for p in os.listdir("/dev/shm") if p.startswith(f"torch_{os.getpid()}_")}


def test_no_shared_memory_left_behind(http, ckpts):
    before = own_segments()
    for _ in range(3):
        keep = []
        entry = encode_bucket(hf_tensors(ckpts["new"])[:6], keep_alive=keep)
        assert push(http, entry, "flattened_bucket").status_code == 200
        del keep, entry
    import gc

    gc.collect()
    after = own_segments()
    assert after <= before, after - before
