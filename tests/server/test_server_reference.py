"""/generate on a tiny HF checkpoint (served with --model-path) against transformers itself, in
process (Litestar's test client)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import load_hf
from tests.support.reference import hf_generate

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[1, 2, 3, 4], [100, 7], [5] * 9]
MAX_NEW = 6


@pytest.fixture(scope="module")
def ckpt(checkpoint) -> Path:
    return checkpoint(seed=3, tokenizer=True)


@pytest.fixture(scope="module")
def srv(start_app, ckpt):
    return start_app("--model-path", str(ckpt))


@torch.no_grad()
def hf_logprobs(hf, prompt: list[int], output_ids: list[int]) -> list[float]:
    """transformers' log-probability of each output token, given the tokens before it."""
    logits = hf(torch.tensor([prompt + output_ids])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(output_ids)), torch.tensor(output_ids)].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_and_logprobs_match_transformers(http, ckpt, prompt):
    hf = load_hf(ckpt)
    want_ids = hf_generate(hf, prompt, MAX_NEW)
    want_lps = hf_logprobs(hf, prompt, want_ids)
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True},
        "return_logprob": True,
    }
    reply = http.post("/generate", json=body).json()
    assert reply["output_ids"] == want_ids
    got_lps = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
    assert got_lps == pytest.approx(want_lps, abs=1e-4)


def test_beams_match_transformers_beam_search(http, ckpt):
    hf, prompt, width = load_hf(ckpt), PROMPTS[0], 4
    out = hf.generate(
        torch.tensor([prompt]),
        do_sample=False,
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=MAX_NEW,
        min_new_tokens=MAX_NEW,
        length_penalty=0.0,  # scores are plain sums of log-probabilities
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    want = [seq[len(prompt) :].tolist() for seq in out.sequences]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "n": width}}
    beams = http.post("/generate", json=body).json()["meta_info"]["beam_results"]
    assert [b["output_ids"] for b in beams] == want
    got = [b["meta_info"]["sequence_score"] for b in beams]
    assert got == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)


def test_text_prompt_uses_the_checkpoint_tokenizer(http):
    by_ids = http.post("/generate", json={"input_ids": [5, 9, 11]}).json()
    by_text = http.post("/generate", json={"text": "t5 t9 t11"}).json()
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["text"] == " ".join(f"t{i}" for i in by_ids["output_ids"])
    assert by_text["meta_info"]["prompt_tokens"] == 3


def test_model_info_reports_the_path(http, ckpt):
    assert http.get("/model_info").json()["model_path"] == str(ckpt)
    assert http.get("/server_info").json()["model_path"] == str(ckpt)
