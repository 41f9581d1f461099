"""A beam-1,024 /generate (FlashRec's n = 1,000; xLLM's beam 512 x top_k 512) against a real
`grctl serve` under its default --max-beam-width, held to a brute-force search over
transformers' logits of the same checkpoint (tests/support/reference.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support.checkpoints import load_hf
from tests.support.reference import assert_beams_match, brute_force_beams
from tests.support.serverproc import running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WIDTH, STEPS, VOCAB = 1024, 3, 2048


def test_beam_1024_over_http_equals_a_brute_force_reference(checkpoint):
    ckpt = checkpoint(seed=11, vocab_size=VOCAB)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    body = {
        "input_ids": prompt,
        "sampling_params": {"n": WIDTH, "max_new_tokens": STEPS, "ignore_eos": True},
    }
    with running_server("--model-path", str(ckpt)) as srv, srv.client(timeout=240) as http:
        reply = http.post("/generate", json=body)
        assert reply.status_code == 200, reply.text
        info = http.get("/server_info").json()
    assert info["max_beam_width"] == WIDTH  # the default, no flag given
    beams = reply.json()["meta_info"]["beam_results"]
    got = [(tuple(b["output_ids"]), b["meta_info"]["sequence_score"]) for b in beams]
    assert_beams_match(got, brute_force_beams(load_hf(ckpt), prompt, WIDTH, STEPS))
