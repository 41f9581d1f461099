"""/generate's behaviour-policy fields over HTTP (in process): every beam's sampling_logprob, the
stochastic beams' gumbel_key, draw_order and gumbel_threshold, return_original_logprob per
request, and SGLang's return_sampling_mask shape; held to transformers' logits with the top_k
filter applied by the test."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.checkpoints import load_hf

pytestmark = pytest.mark.timeout(120)

PROMPT = [1, 2, 3, 4, 9]
_TOP_P_IDS = {"custom_params": {"return_top_p_token_ids": True}}


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint(seed=4)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf(ckpt)


@pytest.fixture(scope="module")
def srv(start_app, ckpt):
    return start_app("--model-path", str(ckpt), "--sampling-mask-max-tokens", "8")


@torch.no_grad()
def top_k_logprobs(hf, out, temperature: float, k: int) -> list[torch.Tensor]:
    """Each step's log_softmax(logits / T) kept to its k best tokens, renormalised [vocab]."""
    logits = hf(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1 : -1].double()
    lp = torch.log_softmax(logits / temperature, -1)
    kth = lp.topk(k, -1).values[:, -1:]
    return list(torch.log_softmax(lp.masked_fill(lp < kth, -math.inf), -1))


def gen(http, sampling: dict, **top) -> dict:
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sampling, **top})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_stochastic_beams_carry_keys_order_threshold_and_behaviour_logprobs(http, hf):
    sp = {
        "n": 4,
        "max_new_tokens": 3,
        "temperature": 0.8,
        "top_k": 5,
        "seed": 3,
        "ignore_eos": True,
    }
    meta = gen(http, sp, return_logprob=True)
    beams = meta["beam_results"]
    keys = [b["meta_info"]["gumbel_key"] for b in beams]
    order = [b["meta_info"]["draw_order"] for b in beams]
    assert sorted(order) == [0, 1, 2, 3]
    assert [keys[order.index(i)] for i in range(4)] == sorted(keys, reverse=True)
    assert meta["gumbel_threshold"] < min(keys)
    for b in beams:
        ids, info = b["output_ids"], b["meta_info"]
        ref = [float(s[t]) for s, t in zip(top_k_logprobs(hf, ids, 0.8, 5), ids, strict=True)]
        assert [lp for lp, _, _ in info["output_token_logprobs"]] == pytest.approx(ref, abs=1e-5)
        assert info["sampling_logprob"] == pytest.approx(sum(ref), abs=1e-5)
    # the model's own log_softmax(logits) on request, the same beams
    orig = gen(http, sp, return_logprob=True, return_original_logprob=True)["beam_results"]
    assert [b["output_ids"] for b in orig] == [b["output_ids"] for b in beams]
    for b in orig:
        ids = b["output_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([PROMPT + ids])).logits[0].double(), -1)
        ref = [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(ids)]
        got = [x for x, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(ref, abs=1e-5)


def test_threshold_null_when_the_support_is_drawn_and_absent_for_deterministic_beams(http):
    whole = gen(http, {"n": 4, "max_new_tokens": 1, "temperature": 1.0, "top_k": 3, "seed": 1})
    assert "gumbel_threshold" in whole and whole["gumbel_threshold"] is None
    assert len(whole["beam_results"]) == 3  # only 3 sequences exist
    det = gen(http, {"n": 3, "max_new_tokens": 2})
    assert "gumbel_threshold" not in det
    for b in det["beam_results"]:
        assert "gumbel_key" not in b["meta_info"] and "draw_order" not in b["meta_info"]
        assert isinstance(b["meta_info"]["sampling_logprob"], float)


def test_return_sampling_mask_in_sglangs_shape(http, hf):
    sp = {"max_new_tokens": 3, "temperature": 1.0, "top_k": 4, "seed": 7, "ignore_eos": True}
    meta = gen(http, sp, return_logprob=True, return_sampling_mask=True)
    ids = meta["beam_results"][0]["output_ids"]
    ref = top_k_logprobs(hf, ids, 1.0, 4)
    masks = meta["output_token_sampling_mask"]
    assert meta["output_token_sampling_mask_length"] == len(masks) == len(ids)
    for mask, step, tok in zip(masks, ref, ids, strict=True):
        assert mask == step.topk(4).indices.tolist() and tok in mask
    selected = meta["output_token_sampling_logprobs"]  # "selected": the chosen token's
    assert selected == pytest.approx([float(s[t]) for s, t in zip(ref, ids, strict=True)], 1e-5)
    assert selected == pytest.approx([lp for lp, _, _ in meta["output_token_logprobs"]], 1e-6)
    support = gen(http, sp, return_sampling_mask=True, sampling_logprobs_mode="support")
    assert support["output_token_sampling_mask"] == masks
    for lps, step in zip(support["output_token_sampling_logprobs"], ref, strict=True):
        assert lps == pytest.approx(step.topk(4).values.tolist(), abs=1e-5)
    beams = gen(http, {**sp, "n": 2}, return_sampling_mask=True)["beam_results"]
    assert all(len(b["meta_info"]["output_token_sampling_mask"]) == 3 for b in beams)
    greedy = gen(http, {"max_new_tokens": 2}, return_sampling_mask=True)  # SGLang's greedy
    assert greedy["output_token_sampling_mask"] == [
        [t] for t in greedy["beam_results"][0]["output_ids"]
    ]
    assert greedy["output_token_sampling_logprobs"] == [0.0, 0.0]


def test_top_p_token_ids_are_each_beams_support_flattened(http, hf):
    """custom_params.return_top_p_token_ids (slime's): meta_info.top_p_token_ids and offsets,
    the top beam's and every beam's, without the sampling-mask fields unless asked too."""
    top_p_ids = {"custom_params": {"return_top_p_token_ids": True}}
    sp = {"max_new_tokens": 3, "temperature": 1.0, "top_k": 4, "ignore_eos": True, **top_p_ids}
    for n in (1, 2):
        meta = gen(http, {**sp, "n": n, "seed": 5})
        assert "output_token_sampling_mask" not in meta
        assert len(meta["beam_results"]) == n
        for where in (meta, *(b["meta_info"] for b in meta["beam_results"])):
            assert "output_token_sampling_mask" not in where
        for b in meta["beam_results"]:
            ids, info = b["output_ids"], b["meta_info"]
            ref = [step.topk(4).indices.tolist() for step in top_k_logprobs(hf, ids, 1.0, 4)]
            assert info["top_p_token_ids"] == [t for r in ref for t in r]
            assert info["top_p_token_offsets"] == [0, 4, 8, 12]
        top = meta["beam_results"][0]["meta_info"]
        assert meta["top_p_token_ids"] == top["top_p_token_ids"]
        assert meta["top_p_token_offsets"] == top["top_p_token_offsets"]
    both = gen(http, {**sp, "seed": 5}, return_sampling_mask=True)
    masks = both["output_token_sampling_mask"]
    assert both["top_p_token_ids"] == [t for m in masks for t in m]
    greedy = gen(http, {"max_new_tokens": 2, **top_p_ids})  # the chosen token alone
    assert greedy["top_p_token_ids"] == greedy["beam_results"][0]["output_ids"]
    assert greedy["top_p_token_offsets"] == [0, 1, 2]
    off = gen(http, {**sp, "custom_params": {"return_top_p_token_ids": False}})
    assert "top_p_token_ids" not in off and "output_token_sampling_mask" not in off


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({"sampling_logprobs_mode": "support"}, "return_sampling_mask"),
        ({"return_sampling_mask": True, "sampling_logprobs_mode": "all"}, "sampling_logprobs_mode"),
        ({"return_sampling_mask": "yes"}, "return_sampling_mask"),
        ({"return_original_logprob": [True]}, "return_original_logprob"),
        # no filter at T = 1: the whole vocabulary, over --sampling-mask-max-tokens 8
        (
            {"return_sampling_mask": True, "sampling_params": {"temperature": 1.0}},
            "sampling-mask-max-tokens",
        ),
        (
            {"sampling_params": {"temperature": 1.0, "top_p": 0.999, **_TOP_P_IDS}},
            "sampling-mask-max-tokens",
        ),
        ({"sampling_params": {"custom_params": {"return_top_p_token_ids": 1}}}, "true or false"),
        ({"sampling_params": {"custom_params": {"return_top_p_token_ids": "true"}}}, "true or"),
        (
            {"sampling_params": {"custom_params": {"return_top_p_token_ids": True, "x": 1}}},
            "'x'",
        ),
    ],
)
def test_sampling_output_refusals(http, body, word):
    r = http.post("/generate", json={"input_ids": PROMPT, **body})
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
