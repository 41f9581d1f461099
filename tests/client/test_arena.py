"""A trainer's weights pushed in place (grctl.rl.arena): transformers' Qwen3 adopted into one
shared-memory arena, trained in place, pushed by WeightSync to a real server serving bfloat16.
The float32 arena goes as it lies, in one call, with no staging buffer made on the client; the
server casts, and its checksums equal the trainer's tensors cast to bfloat16."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

from grctl.client import WeightSync, buffers
from grctl.rl.arena import Arena
from grctl.weights.checker import tensor_sha256
from tests.support.checkpoints import load_hf
from tests.support.reference import hf_generate
from tests.support.serverproc import REPO_ROOT
from tests.support.weight_helpers import served_by_client, served_sha256

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def srv(start_server, checkpoint):
    served = checkpoint(seed=41, dtype=torch.bfloat16)
    return start_server("--allow-weight-update", "--model-path", str(served))


def expected(hf, dtype=torch.bfloat16) -> dict[str, str]:
    state = hf.state_dict()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {name: tensor_sha256(t.to(dtype)) for name, t in state.items()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_adopt_keeps_the_model_and_lays_it_in_one_segment(checkpoint, tied):
    hf = load_hf(checkpoint(seed=42, tie_word_embeddings=tied))
    assert hf.config.tie_word_embeddings == tied  # Qwen3-0.6B/1.7B/4B tie theirs
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        before = hf(prompt).logits
    arena = Arena.adopt(hf)
    start, end = arena.flat.data_ptr(), arena.flat.data_ptr() + arena.nbytes
    for name, p in hf.state_dict().items():
        assert start <= p.data_ptr() < end, name  # every parameter and buffer lives there
    with torch.no_grad():
        assert torch.equal(hf(prompt).logits, before)
    views = arena.tensors()
    assert all(torch.equal(views[n], t) for n, t in hf.state_dict().items() if n in views)
    head, embed = hf.lm_head.weight, hf.model.embed_tokens.weight
    assert (head.data_ptr() == embed.data_ptr()) == tied  # still one weight when tied
    assert ("lm_head.weight" in views) == (not tied)  # pushed once, under its first name


def test_arena_pushed_in_place_and_cast_by_the_server(srv, http, checkpoint):
    hf = load_hf(checkpoint(seed=43))  # float32, another seed than the server's
    arena = Arena.adopt(hf)
    buffers.release()
    opt = torch.optim.SGD(hf.parameters(), lr=0.5)
    with WeightSync(srv.url, verify=False) as sync:
        for step in range(2):
            opt.zero_grad()
            hf(torch.tensor([[2, 7, 1, 8]]), labels=torch.tensor([[2, 7, 1, 8]])).loss.backward()
            opt.step()  # writes the arena's views in place
            result = sync.run(arena, weight_version=f"s{step}")
            (out,) = result.servers
            assert result.ok and out.resumed and out.weight_version == f"s{step}"
            assert result.num_buckets == 1 and out.num_buckets == 1  # one call
            assert result.num_bytes >= arena.nbytes - 4096  # float32 bytes: not cast here
            assert served_sha256(http) == expected(hf)
    assert "cpu" not in buffers._kept  # no staging buffer was made for it
    bf16 = hf.to(torch.bfloat16)
    want = hf_generate(bf16, [5, 6, 7], 4)
    assert served_by_client(srv.url, [5, 6, 7], 4) == (want, "s1")


def test_a_tied_model_adopted_and_pushed_to_a_tied_server(start_server, checkpoint):
    """The built-in model and Qwen3-0.6B/1.7B/4B tie lm_head to the embedding: the arena holds
    it once, the push sends it once, and the server generates as the trained model does."""
    srv = start_server(
        "--allow-weight-update",
        "--model-path",
        str(checkpoint(seed=45, tie_word_embeddings=True, dtype=torch.bfloat16)),
    )
    hf = load_hf(checkpoint(seed=46, tie_word_embeddings=True))
    arena = Arena.adopt(hf)
    opt = torch.optim.SGD(hf.parameters(), lr=0.5)
    hf(torch.tensor([[2, 7, 1, 8]]), labels=torch.tensor([[2, 7, 1, 8]])).loss.backward()
    opt.step()  # moves the tied weight through its one view
    with WeightSync(srv.url, verify=False) as sync:
        assert sync.run(arena, weight_version="t1").ok
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert served_sha256(http) == expected(hf)
    want = hf_generate(hf.to(torch.bfloat16), [5, 6, 7], 4)
    assert served_by_client(srv.url, [5, 6, 7], 4) == (want, "t1")


TRAINER = """
import os, sys
from grctl.client import WeightSync
from grctl.rl.arena import Arena
from tests.support.checkpoints import load_hf
hf = load_hf(sys.argv[2])
with WeightSync(sys.argv[1]) as sync:
    sync.run(hf.state_dict(), weight_version="kept")  # staged: the process keeps its buffers
    arena = Arena.adopt(hf)
    sync.run(arena, weight_version="arena")
print(os.getpid())
"""


def test_a_trainer_that_exits_leaves_no_segment_while_the_server_lives(srv, checkpoint):
    """The server stays connected to the trainer's shm manager, so whatever segment the
    trainer still held at exit would stay in /dev/shm as long as the server: none does."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-c", TRAINER, srv.url, str(checkpoint(seed=44))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = done.stdout.split()[-1]
    deadline = time.monotonic() + 5
    while left := [p for p in os.listdir("/dev/shm") if p.startswith(f"torch_{pid}_")]:
        assert time.monotonic() < deadline, left
        time.sleep(0.05)
