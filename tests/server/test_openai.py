"""The OpenAI-compatible routes driven by the `openai` package itself, on a real server over a
tiny checkpoint with a word tokenizer and a chat template, held to transformers; the catalog
case in process over the built-in model."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.support.appserver import AppTransport, app_server
from tests.support.catalogs import write_catalog
from tests.support.checkpoints import load_hf, with_chat_template
from tests.support.reference import hf_generate
from tests.support.serverproc import assert_error
from tests.support.trainer_side import hf_state, tensor_entry

pytestmark = pytest.mark.timeout(180)

KEY = "sk-openai-test"
NAME = "gr-tiny"
PROMPT = [1, 2, 3, 4]
# "t5 t9" from the user becomes "t5 t9 t1": t1 opens the assistant's turn.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}t1{% endif %}"
)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def ckpt(checkpoint, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("chat") / "ckpt"
    return with_chat_template(checkpoint(seed=3, tokenizer=True), dst, TEMPLATE)


@pytest.fixture(scope="module")
def srv(start_server, ckpt):
    flags = ("--model-path", str(ckpt), "--served-model-name", NAME, "--api-key", KEY)
    return start_server(*flags, "--allow-weight-update")


@pytest.fixture(scope="module")
def oa(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(srv):
    with srv.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


@torch.no_grad()
def hf_logprobs(hf, prompt: list[int], output_ids: list[int]) -> list[float]:
    logits = hf(torch.tensor([prompt + output_ids])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(output_ids)), torch.tensor(output_ids)].tolist()


def test_models(oa, srv, ckpt):
    (card,) = oa.models.list().data
    assert card.id == NAME and card.root == str(ckpt) and card.owned_by == "grctl"
    # the served context: the checkpoint's 512 positions (--max-context-len 0), not the flag's 0
    assert card.model_dump()["max_model_len"] == 512
    assert oa.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("another-model")
    wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        wrong.models.list()


def test_completions_match_transformers(oa, ckpt):
    hf = load_hf(ckpt)
    want = hf_generate(hf, PROMPT, 5)
    out = oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, logprobs=1, **GREEDY)
    (choice,) = out.choices
    assert choice.text == words(want) and choice.finish_reason == "length"
    assert choice.meta_info["output_ids"] == want
    assert choice.logprobs.tokens == [f"t{i}" for i in want]
    assert choice.logprobs.token_logprobs == pytest.approx(hf_logprobs(hf, PROMPT, want), abs=1e-4)
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 5
    assert out.model == NAME and out.object == "text_completion"
    by_text = oa.completions.create(model=NAME, prompt=words(PROMPT), max_tokens=5, **GREEDY)
    assert by_text.choices[0].text == choice.text
    batch = oa.completions.create(model=NAME, prompt=[PROMPT, [7, 8]], max_tokens=3, **GREEDY)
    texts = [c.text for c in batch.choices]
    assert texts == [words(hf_generate(hf, PROMPT, 3)), words(hf_generate(hf, [7, 8], 3))]
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.prompt_tokens == 6


def test_beams_are_choices_best_first(oa, http, ckpt):
    hf, width, new = load_hf(ckpt), 4, 5
    ref = hf.generate(
        torch.tensor([PROMPT]),
        do_sample=False,
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=new,
        min_new_tokens=new,
        length_penalty=0.0,
        pad_token_id=0,
    )
    want = [seq[len(PROMPT) :].tolist() for seq in ref]
    out = oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=new, n=width, **GREEDY)
    assert [c.meta_info["output_ids"] for c in out.choices] == want
    assert [c.text for c in out.choices] == [words(w) for w in want]
    body = {"input_ids": PROMPT, "sampling_params": {"n": width, "max_new_tokens": new}}
    beams = http.post("/generate", json={**body}).json()["meta_info"]["beam_results"]
    scores = [c.meta_info["sequence_score"] for c in out.choices]
    assert scores == pytest.approx([b["meta_info"]["sequence_score"] for b in beams])
    assert scores == sorted(scores, reverse=True)
    assert {c.meta_info["weight_version"] for c in out.choices} == {"default"}
    top = len(out.choices[0].meta_info["output_ids"])
    spans = [{"version": "default", "start": 0, "end": top}]
    assert out.metadata == {"weight_version": "default", "weight_versions": spans}


def test_chat_goes_through_the_template(oa, ckpt):
    want = hf_generate(ckpt, [5, 9, 1], 4)  # the template's "t5 t9 t1"
    for content in ("t5 t9", [{"type": "text", "text": "t5 t9"}]):
        out = oa.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": content}],
            max_tokens=4,
            logprobs=True,
            **GREEDY,
        )
        (choice,) = out.choices
        assert choice.message.role == "assistant" and choice.message.content == words(want)
        assert [t.token for t in choice.logprobs.content] == [f"t{i}" for i in want]
        assert out.usage.prompt_tokens == 3 and out.object == "chat.completion"


def test_streams(oa, http):
    ask = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "n": 2, **GREEDY}
    full = oa.completions.create(**ask)
    chunks = list(oa.completions.create(**ask, stream=True))
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks] == [
        (c.index, c.text) for c in full.choices
    ]
    messages = [{"role": "user", "content": "t5 t9"}]
    chat = oa.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    events = list(chat)
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    whole = oa.chat.completions.create(model=NAME, messages=messages, max_tokens=3, **GREEDY)
    assert text == whole.choices[0].message.content
    assert events[-2].choices[0].finish_reason == "length" and events[-1].usage.total_tokens == 6
    # On the wire: server-sent events, ending with the [DONE] sentinel.
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_refusals_apply_as_on_generate(oa, http, ckpt):
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        oa.completions.create(model=NAME, prompt=PROMPT, stop=["t3"])
    assert http.post("/pause_generation", json={}).status_code == 200
    try:
        with pytest.raises(openai.APIStatusError) as err:
            oa.completions.create(model=NAME, prompt=PROMPT, stream=True)
        assert err.value.status_code == 503 and err.value.body["code"] == "paused"
    finally:
        http.post("/continue_generation")
    # A tensor labelled alone leaves the weights mixed: nothing is served until relabelled.
    keep: list = []
    norm = [(n, t) for n, t in hf_state(ckpt) if n == "model.norm.weight"]
    entry = tensor_entry(norm, keep)
    push = {"serialized_named_tensors": [entry], "load_format": "flattened_bucket"}
    push["weight_version"] = "B"
    assert http.post("/update_weights_from_tensor", json=push).status_code == 200
    mixed = http.post("/v1/chat/completions", json={"messages": [{"content": "t5"}]})
    assert_error(mixed, 503, "weights_mixed")
    assert http.post("/update_weight_version", json={"new_version": "default"}).status_code == 200
    assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    try:
        assert_error(http.post("/v1/completions", json={"prompt": PROMPT}), 503, "memory_released")
    finally:
        http.post("/resume_memory_occupation", json={})
    assert oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=1).choices[0].text


def test_without_a_tokenizer_chat_and_text_are_400(builtin_app):
    with builtin_app.client() as c:
        chat = c.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]})
        assert "tokenizer" in assert_error(chat, 400, "validation_error")["message"]
        text = c.post("/v1/completions", json={"prompt": "hi"})
        assert "token ids" in assert_error(text, 400, "validation_error")["message"]
        (choice,) = c.post("/v1/completions", json={"prompt": [1, 2]}).json()["choices"]
        assert choice["text"] == " ".join(map(str, choice["meta_info"]["output_ids"]))


def test_catalog_items_ride_on_the_choices(tmp_path):
    items = write_catalog(tmp_path / "items.jsonl", 1, 3000)
    with app_server("--catalog-jsonl", str(tmp_path / "items.jsonl")) as app:
        transport = AppTransport(app.test_client)
        with httpx.Client(transport=transport, base_url=app.url + "/v1") as raw:
            oa = openai.OpenAI(base_url=app.url + "/v1", api_key="none", http_client=raw)
            prompt = [1, 7, 300, 600, 900]
            out = oa.completions.create(model="m", prompt=prompt, max_tokens=3, n=4, temperature=0)
            with app.client() as c:
                body = {"input_ids": prompt, "sampling_params": {"n": 4, "max_new_tokens": 3}}
                rows = c.post("/generate", json=body).json()["meta_info"]["item_results"]
    assert len(out.choices) == 4
    for choice, row in zip(out.choices, rows, strict=True):
        meta = choice.meta_info
        assert meta["output_ids"] == row["token_ids"] and meta["item_ids"] == row["item_ids"]
        assert meta["item_ids"] == items[tuple(meta["output_ids"])] and meta["is_complete"]
        assert choice.finish_reason == "stop"
        assert meta["finish_reason"] == {"type": "stop", "item_id": meta["item_id"]}
        assert meta["catalog_version"] is not None
