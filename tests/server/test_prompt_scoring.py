"""Prompt scoring over HTTP, in process on a tiny checkpoint with a word tokenizer: SGLang's
input_token_logprobs / input_top_logprobs (max_new_tokens 0, logprob_start_len), held to
transformers; candidates after one prompt sharing its KV (cached_tokens, /metrics); OpenAI's
echo; the 400s."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import load_hf

pytestmark = pytest.mark.timeout(120)

PROMPT = [1, 2, 3, 4, 9, 17, 33]


@pytest.fixture(scope="module")
def ckpt(checkpoint) -> Path:
    return checkpoint(seed=4, tokenizer=True)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf(ckpt)


@pytest.fixture(scope="module")
def srv(start_app, ckpt):
    return start_app("--model-path", str(ckpt))


@torch.no_grad()
def ref(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row j is the log-distribution of token j + 1 given ids[: j + 1]."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)


def scores(hf, ids: list[int], start: int) -> list[float]:
    lp = ref(hf, ids)
    return [lp[j - 1, ids[j]].item() for j in range(start + 1, len(ids))]


def score(http, ids, start, **body) -> dict:
    sp = body.pop("sampling_params", {"max_new_tokens": 0})
    payload = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    reply = http.post("/generate", json={**payload, "logprob_start_len": start, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_sglang_shape_and_values(http, hf):
    meta = score(http, PROMPT, 2, top_logprobs_num=3, return_text_in_logprobs=True)["meta_info"]
    entries = meta["input_token_logprobs"]
    assert entries[0] == [None, PROMPT[2], "t3"]
    assert [e[1] for e in entries] == PROMPT[2:]
    assert [e[2] for e in entries] == [f"t{t}" for t in PROMPT[2:]]
    got = [e[0] for e in entries[1:]]
    assert got == pytest.approx(scores(hf, PROMPT, 2), abs=1e-5)
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(entries) and tops[0] is None
    lp = ref(hf, PROMPT)
    for j, row in zip(range(3, len(PROMPT)), tops[1:], strict=True):
        vals, idx = lp[j - 1].topk(3)
        assert [e[1] for e in row] == idx.tolist()
        assert [e[0] for e in row] == pytest.approx(vals.tolist(), abs=1e-5)
        assert [e[2] for e in row] == [f"t{i}" for i in idx.tolist()]
    # max_new_tokens 0: nothing generated, SGLang's length finish
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []


def test_prompt_and_continuation(http, hf):
    """Scored from the start (the first entry null), then generating as without it."""
    sp = {"max_new_tokens": 3, "ignore_eos": True}
    plain = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
    reply = score(http, PROMPT, 0, sampling_params=sp)
    assert reply["output_ids"] == plain["output_ids"] and len(reply["output_ids"]) == 3
    entries = reply["meta_info"]["input_token_logprobs"]
    assert entries[0] == [None, PROMPT[0], None] and len(entries) == len(PROMPT)
    assert [e[0] for e in entries[1:]] == pytest.approx(scores(hf, PROMPT, 0), abs=1e-5)
    assert "input_top_logprobs" not in reply["meta_info"]
    unscored = score(http, PROMPT, -1, sampling_params=sp)["meta_info"]
    assert unscored["input_token_logprobs"] == []


def test_a_batch_with_one_start_per_prompt(http, hf):
    rows = [PROMPT, [5, 6, 7, 8, 9]]
    replies = score(http, rows, [1, 4])
    assert [len(r["meta_info"]["input_token_logprobs"]) for r in replies] == [6, 1]
    got = [e[0] for e in replies[0]["meta_info"]["input_token_logprobs"][1:]]
    assert got == pytest.approx(scores(hf, PROMPT, 1), abs=1e-5)
    assert replies[1]["meta_info"]["input_token_logprobs"] == [[None, 9, None]]


def series(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def test_items_scored_for_one_user_share_the_prompt_kv(start_app, ckpt, hf):
    """One /generate batch of user + item for many items: every item after the first continues
    the user's cached KV (meta_info.cached_tokens, the /metrics counter), each item's tokens
    scored as transformers scores them."""
    srv = start_app("--model-path", str(ckpt))
    user = [(7 * i + 3) % 120 for i in range(48)]
    items = [[10 + i, 60 + i, 90 + i] for i in range(8)]
    start = len(user) - 1  # the first entry (null) is the user's last token
    with srv.client() as http:
        replies = score(http, [user + item for item in items], start)
        metrics = http.get("/metrics").text
    cached = [r["meta_info"]["cached_tokens"] for r in replies]
    assert cached[0] == 0 and all(32 <= c <= start for c in cached[1:]), cached
    assert series(metrics, "gr_prefill_cache_hit_tokens_total") == sum(cached)
    for item, r in zip(items, replies, strict=True):
        entries = r["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == [user[-1], *item]
        want = scores(hf, user + item, start)
        assert [e[0] for e in entries[1:]] == pytest.approx(want, abs=1e-5)


def test_openai_echo_with_logprobs(http, hf):
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    words = " ".join(f"t{t}" for t in PROMPT)
    assert choice["text"] == words and choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert lps["tokens"] == words.split() and lps["token_logprobs"][0] is None
    assert lps["token_logprobs"][1:] == pytest.approx(scores(hf, PROMPT, 0), abs=1e-5)
    assert lps["top_logprobs"] == [None] * len(PROMPT)  # logprobs 0: no alternatives
    tops = http.post("/v1/completions", json={**body, "logprobs": 2}).json()["choices"][0]
    alts = tops["logprobs"]["top_logprobs"]
    assert alts[0] is None and len(alts) == len(PROMPT)
    lp = ref(hf, PROMPT)
    for j, alt in enumerate(alts[1:], start=1):
        vals, idx = lp[j - 1].topk(2)
        assert list(alt) == [f"t{i}" for i in idx.tolist()]
        assert list(alt.values()) == pytest.approx(vals.tolist(), abs=1e-5)
    more = http.post("/v1/completions", json={**body, "max_tokens": 2}).json()["choices"][0]
    assert more["text"].startswith(words) and len(more["text"]) > len(words)
    assert len(more["logprobs"]["tokens"]) == len(PROMPT) + 2
    plain = http.post("/v1/completions", json={**body, "echo": False, "max_tokens": 2}).json()
    assert more["logprobs"]["token_logprobs"][len(PROMPT) :] == pytest.approx(
        plain["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6
    )


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        ({"logprob_start_len": len(PROMPT) + 1}, "logprob_start_len"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"logprob_start_len": [0, 1]}, "logprob_start_len"),
    ],
)
def test_refusals(http, extra, word):
    body = {"input_ids": PROMPT, "return_logprob": True, **extra}
    reply = http.post("/generate", json=body)
    assert reply.status_code == 400 and word in reply.text
