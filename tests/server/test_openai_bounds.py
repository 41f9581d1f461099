"""The OpenAI routes under hostile bodies: only documented chat_template_kwargs reach the served
template (a client's own template, tools, tokenize... are a 400), a template that refuses the
messages is a 400, /v1/completions checks the queue bound before tokenizing, and top logprobs
are the model's own (held to transformers' log-softmax), never silently empty."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import load_hf, with_chat_template
from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(180)

# "t5 t9" from the user becomes "t5 t9 t1" (t2 with enable_thinking false: the flag reaches the
# template); a "system" turn makes the template raise, as a real one refusing roles would.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('system turns are not served') }}{% endif %}"
    "{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if enable_thinking is defined and not enable_thinking %}t2{% else %}t1{% endif %}"
    "{% endif %}"
)
USER = [{"role": "user", "content": "t5 t9"}]


@pytest.fixture(scope="module")
def ckpt(checkpoint, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("chat-bounds") / "ckpt"
    return with_chat_template(checkpoint(seed=3, tokenizer=True), dst, TEMPLATE)


@pytest.fixture(scope="module")
def srv(start_app, ckpt):
    return start_app("--model-path", str(ckpt), "--max-waiting-requests", "64")


def chat(http, **body):
    body = {"messages": USER, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **body}
    return http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}, "own chat template"),
        ({"chat_template": 7}, "own chat template"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tokenize": True}, "tokenize"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"messages": []}, "messages"),
        ({"enable_thinking": "yes"}, "enable_thinking must be bool"),
        ({"reasoning_effort": "x" * 10_000}, "reasoning_effort must be"),
        ({"k" * 100_000: 1}, "is not supported"),
    ],
)
def test_undocumented_template_kwargs_are_a_400(http, kwargs, says):
    started = time.monotonic()
    err = assert_error(chat(http, chat_template_kwargs=kwargs), 400, "validation_error")
    assert says in err["message"] and len(err["message"]) < 400
    assert time.monotonic() - started < 5  # refused, never rendered


def test_documented_kwargs_reach_the_template(http, ckpt):
    hf = load_hf(ckpt)
    for kwargs, opener in (
        ({}, 1),
        ({"enable_thinking": True}, 1),
        ({"enable_thinking": False}, 2),
    ):
        out = chat(http, chat_template_kwargs=kwargs)
        assert out.status_code == 200, out.text
        prompt = torch.tensor([[5, 9, opener]])
        want = hf.generate(prompt, max_new_tokens=2, do_sample=False, eos_token_id=None)
        ids = out.json()["choices"][0]["meta_info"]["output_ids"]
        assert ids == want[0, 3:].tolist() and out.json()["usage"]["prompt_tokens"] == 3


def test_a_template_refusing_the_messages_is_a_400(http):
    system = [{"role": "system", "content": "t3"}, *USER]
    err = assert_error(chat(http, messages=system), 400, "validation_error")
    assert "system turns are not served" in err["message"]


def test_completions_check_the_queue_before_tokenizing(srv, http, monkeypatch):
    tok, encoded = srv.app.state.tokenizer, []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **kw: encoded.append(1) or encode(*a, **kw))
    resp = http.post("/v1/completions", json={"prompt": ["t5"] * 100_000, "max_tokens": 1})
    assert "waiting queue" in assert_error(resp, 400, "validation_error")["message"]
    assert encoded == []  # not one prompt was tokenized
    ok = http.post("/v1/completions", json={"prompt": ["t5", "t6"], "max_tokens": 1})
    assert ok.status_code == 200 and len(encoded) == 2


@torch.no_grad()
def hf_top(hf, prompt: list[int], output_ids: list[int], k: int) -> list[list[tuple[int, float]]]:
    logits = hf(torch.tensor([prompt + output_ids])).logits[0, len(prompt) - 1 : -1].float()
    top = torch.log_softmax(logits, -1).topk(k, -1)
    return [list(zip(i.tolist(), v.tolist(), strict=True)) for v, i in zip(*top, strict=True)]


def test_chat_top_logprobs_are_the_models(http, ckpt):
    out = chat(http, logprobs=True, top_logprobs=3, max_tokens=3)
    assert out.status_code == 200, out.text
    (choice,) = out.json()["choices"]
    content = choice["logprobs"]["content"]
    want = hf_top(load_hf(ckpt), [5, 9, 1], choice["meta_info"]["output_ids"], 3)
    assert len(content) == len(want) == 3
    for entry, alts in zip(content, want, strict=True):
        got = [(int(a["token"][1:]), a["logprob"]) for a in entry["top_logprobs"]]
        assert [t for t, _ in got] == [t for t, _ in alts]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in alts], abs=1e-4)
        assert entry["token"] == entry["top_logprobs"][0]["token"]  # greedy: the best one
    assert_error(chat(http, top_logprobs=2), 400, "validation_error")  # without logprobs
    assert_error(chat(http, logprobs=True, top_logprobs=21), 400, "validation_error")


def test_completion_logprobs_k_gives_k_alternatives(http, ckpt):
    body = {"prompt": [5, 9], "max_tokens": 2, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    out = http.post("/v1/completions", json=body)
    assert out.status_code == 200, out.text
    lp = out.json()["choices"][0]["logprobs"]
    want = hf_top(load_hf(ckpt), [5, 9], out.json()["choices"][0]["meta_info"]["output_ids"], 2)
    for alts, ref in zip(lp["top_logprobs"], want, strict=True):
        assert list(alts) == [f"t{t}" for t, _ in ref]
        assert list(alts.values()) == pytest.approx([v for _, v in ref], abs=1e-4)
    plain = http.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
    assert plain["logprobs"]["top_logprobs"] == [None, None]
