"""/generate on a tiny HF checkpoint (served with --model-path) against transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.support.checkpoints import TINY, load_hf, write_checkpoint
from tests.support.serverproc import running_server

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[1, 2, 3, 4], [100, 7], [5] * 9]
MAX_NEW = 6


def write_word_tokenizer(path: Path) -> None:
    """A whitespace word tokenizer over the tiny vocabulary: "t5 t9" <-> [5, 9]."""
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("ref-qwen3"), seed=3)
    write_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def http(ckpt):
    with running_server("--model-path", str(ckpt)) as srv, srv.client() as client:
        yield client


@torch.no_grad()
def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy decoding by HF forward passes: the ids and each chosen token's log-probability."""
    ids, logprobs = list(prompt), []
    for _ in range(MAX_NEW):
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        tok = int(lp.argmax())
        ids.append(tok)
        logprobs.append(float(lp[tok]))
    return ids[len(prompt) :], logprobs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_and_logprobs_match_transformers(http, ckpt, prompt):
    want_ids, want_lps = hf_greedy(load_hf(ckpt), prompt)
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
