"""/generate's sampling parameters on a tiny HF checkpoint with a tokenizer, in process: SGLang's
beam_width form and its reply, every beam's logprobs against transformers' forward, stochastic
beams, stop strings, and the 400 naming each SGLang knob grctl does not implement."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import load_hf

pytestmark = pytest.mark.timeout(120)

PROMPT = [1, 2, 3, 4, 9]


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
def hf_logprobs(hf, prompt, out, temperature: float = 1.0) -> list[float]:
    logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp[torch.arange(len(out)), torch.tensor(out)].tolist()


def gen(http, sampling: dict, **top) -> dict:
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sampling, **top})
    assert r.status_code == 200, r.text
    return r.json()


def test_beam_width_reply_is_sglangs(http):
    sp = {"beam_width": 4, "n": 3, "max_new_tokens": 3, "ignore_eos": True}
    reply = gen(http, sp)
    meta = reply["meta_info"]
    beams = meta["beam_results"]
    assert len(beams) == 3
    full = gen(http, {"n": 4, "max_new_tokens": 3, "ignore_eos": True})["meta_info"]
    assert [b["output_ids"] for b in beams] == [b["output_ids"] for b in full["beam_results"][:3]]
    # the best beam at the top level; beam 0 carries the completion tokens of all 3
    assert reply["output_ids"] == beams[0]["output_ids"]
    assert reply["text"] == beams[0]["text"] == " ".join(f"t{i}" for i in beams[0]["output_ids"])
    assert beams[0]["meta_info"]["completion_tokens"] == meta["completion_tokens"] == 9
    assert meta["sequence_score"] == beams[0]["meta_info"]["sequence_score"]
    for b in beams[1:]:
        # SGLang's keys, the beam's weight-version spans and its behaviour log-probability
        keys = {"finish_reason", "sequence_score", "weight_versions", "sampling_logprob"}
        assert set(b["meta_info"]) == keys
    assert beams[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    # grctl's own form (no beam_width) is unchanged: no summed count on beam 0
    assert "completion_tokens" not in full["beam_results"][0]["meta_info"]
    assert "sequence_score" not in full


def same_beams(a: list[dict], b: list[dict]) -> bool:
    """The same beams, scores within float noise (a batch's prefill packs other prompts)."""
    a, b = copy.deepcopy(a), copy.deepcopy(b)
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    for x, y in zip(a, b, strict=True):
        for key in ("sequence_score", "sampling_logprob"):
            sx, sy = x["meta_info"].pop(key), y["meta_info"].pop(key)
            assert sx == pytest.approx(sy, abs=1e-4)
        assert x == y
    return True


def test_beam_width_batch_and_submit_result_follow(http):
    sp = {"beam_width": 3, "n": 2, "max_new_tokens": 2}
    one = gen(http, sp)
    batch = http.post(
        "/generate", json={"input_ids": [PROMPT, [7, 8]], "sampling_params": sp}
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert same_beams(batch[0]["meta_info"]["beam_results"], one["meta_info"]["beam_results"])
    rid = http.post("/submit", json={"input_ids": PROMPT, "sampling_params": sp}).json()
    res = http.get(f"/result/{rid['request_id']}", params={"timeout": 30}).json()
    assert same_beams(res["meta_info"]["beam_results"], one["meta_info"]["beam_results"])


def test_every_beam_reports_logprobs_as_the_trainer_recomputes(http, hf):
    top = {"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    sp = {"beam_width": 4, "n": 4, "max_new_tokens": 3, "ignore_eos": True}
    meta = gen(http, sp, **top)["meta_info"]
    assert meta["input_token_logprobs"] == []
    for beam in meta["beam_results"]:
        ids, entries = beam["output_ids"], beam["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in entries] == ids
        assert [text for _, _, text in entries] == [f"t{i}" for i in ids]
        assert [lp for lp, _, _ in entries] == pytest.approx(hf_logprobs(hf, PROMPT, ids), abs=1e-4)
        tops = beam["meta_info"]["output_top_logprobs"]
        assert len(tops) == len(ids) and all(len(row) == 2 for row in tops)
        assert all(
            row[0][0] >= row[1][0] and row[0][0] >= lp
            for row, (lp, _, _) in zip(tops, entries, strict=True)
        )
    assert (
        meta["output_token_logprobs"]
        == meta["beam_results"][0]["meta_info"]["output_token_logprobs"]
    )
    assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"])


def test_stochastic_beams_over_http(http, hf):
    sp = {"n": 4, "max_new_tokens": 3, "temperature": 0.7, "sampling_seed": 21, "ignore_eos": True}
    a = gen(http, sp, return_logprob=True)["meta_info"]["beam_results"]
    b = gen(http, sp, return_logprob=True)["meta_info"]["beam_results"]
    assert a == b  # seeded
    seqs = [tuple(x["output_ids"]) for x in a]
    assert len(set(seqs)) == 4
    for beam in a:
        ids = beam["output_ids"]
        got = [lp for lp, _, _ in beam["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_logprobs(hf, PROMPT, ids, 0.7), abs=1e-4)
        score = beam["meta_info"]["sequence_score"]
        assert score == pytest.approx(sum(hf_logprobs(hf, PROMPT, ids)), abs=1e-4)


def test_stop_strings_end_the_text_and_are_trimmed(http):
    ids = gen(http, {"max_new_tokens": 8, "ignore_eos": True})["output_ids"]
    words = [f"t{i}" for i in ids]
    stop = f"{words[2]} {words[3]}"
    end = next(k for k in range(1, 9) if stop in " ".join(words[:k]))
    reply = gen(http, {"max_new_tokens": 8, "ignore_eos": True, "stop": stop})
    assert reply["output_ids"] == ids[:end]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    text = " ".join(words[:end])
    assert reply["text"] == text[: text.find(stop)]
    kept = gen(
        http, {"max_new_tokens": 8, "ignore_eos": True, "stop": [stop], "no_stop_trim": True}
    )
    assert kept["text"] == text


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        ("sp", "frequency_penalty", 0.5),
        ("sp", "presence_penalty", -1.0),
        ("sp", "repetition_penalty", 1.2),
        ("sp", "stop_regex", "t1"),
        ("sp", "json_schema", "{}"),
        ("sp", "regex", "t[0-9]"),
        ("sp", "ebnf", "root ::= x"),
        ("sp", "logit_bias", {"5": 2.0}),
        ("top", "token_ids_logprob", [1, 2]),
        ("top", "return_hidden_states", True),
        ("top", "custom_logit_processor", "x"),
    ],
)
def test_unimplemented_sglang_knobs_are_a_400_naming_them(http, where, key, value):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    (body["sampling_params"] if where == "sp" else body)[key] = value
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and key in r.json()["error"]["message"]


def test_no_op_defaults_of_those_knobs_are_accepted(http):
    neutral = {
        "frequency_penalty": 0.0,
        "presence_penalty": 0,
        "repetition_penalty": 1.0,
        "stop_regex": None,
        "json_schema": "",
        "logit_bias": {},
        "stream_interval": 4,
    }
    plain = gen(http, {"max_new_tokens": 2})
    assert gen(http, {"max_new_tokens": 2, **neutral})["output_ids"] == plain["output_ids"]
    assert gen(http, {"max_new_tokens": 2}, logprob_start_len=-1, return_logprob=True)
    # logprob_start_len is served since prompt scoring landed (tests/server/test_prompt_scoring.py)
    r = http.post(
        "/generate", json={"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0}
    )
    assert r.status_code == 200 and len(r.json()["meta_info"]["input_token_logprobs"]) == 5


def test_beam_width_refusals(http):
    for sp, word in (
        ({"beam_width": 2, "n": 3}, "cannot exceed beam_width"),
        ({"n": 2, "stop": "t1"}, "stop strings"),
        ({"n": 1, "length_penalty": 1.0}, "length_penalty"),
        ({"seed": 1, "sampling_seed": 2}, "sampling_seed"),
    ):
        r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
        assert r.status_code == 400 and word in r.json()["error"]["message"], (sp, r.text)


@pytest.mark.parametrize(
    ("sp", "field"),
    [
        ({"temperature": 1e308}, "temperature"),  # float32 inf: logits / inf
        ({"temperature": 100.5}, "temperature"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"n": 2, "length_penalty": 1e308}, "length_penalty"),  # length ** inf ties every beam
        ({"n": 2, "length_penalty": -10.5}, "length_penalty"),
    ],
)
def test_sampling_knobs_past_float32_are_a_400_naming_them(http, sp, field):
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.text
    r = http.post("/v1/completions", json={"prompt": [PROMPT], "max_tokens": 1, **sp})
    if "length_penalty" not in sp:  # an SGLang extra that OpenAI's body does not carry
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_sampling_knobs_at_their_bounds_are_served(http):
    for sp in ({"temperature": 100.0}, {"top_k": 1 << 30}, {"n": 2, "length_penalty": 10.0}):
        assert gen(http, {"max_new_tokens": 2, **sp})["output_ids"], sp


@pytest.mark.parametrize("size", ["small", "large"])  # large: scanned off the event loop
def test_a_key_named_twice_is_a_400_naming_it(http, size):
    pad = "" if size == "small" else ', "rid_pad": [' + ",".join(["1"] * 40_000) + "]"
    raw = (
        '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "temperature": 0, '
        '"temperature": 5}' + pad + "}"
    )
    r = http.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "'temperature' twice" in r.json()["error"]["message"], r.text
    top = '{"input_ids": [1, 2], "input_ids": [3], "sampling_params": {"max_new_tokens": 1}}'
    r = http.post("/generate", content=top, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "'input_ids' twice" in r.json()["error"]["message"], r.text
    # the same key in two objects is fine
    ok = '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "max_new_tokens": 1}'
    r = http.post("/generate", content=ok, headers={"content-type": "application/json"})
    assert r.status_code != 500 and "twice" not in r.text, r.text
