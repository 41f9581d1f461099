"""Multi-stage requests against a real `grctl serve` over a tiny Qwen3, transformers' Qwen3 over
the same checkpoint the reference: every behaviour logprob of the reasoning and of the beams,
the beams' scores, one reply equal to the same work as separate requests, the group store
(docs/http-api.md "Multi-stage requests")."""

from __future__ import annotations

import json

import pytest

from tests.support.catalogs import TWO_LENGTH_ITEMS
from tests.support.checkpoints import load_hf
from tests.support.reference import hf_token_logprobs

PROMPT = [1, 2, 3, 4]
STOP = 7  # a reasoning stop token
PREFIX = [9, 10]
T1 = 0.7


@pytest.fixture(scope="module")
def served(checkpoint, start_server, tmp_path_factory):
    ckpt = checkpoint(seed=0, tokenizer=True)
    cat = tmp_path_factory.mktemp("stage-catalog") / "items.jsonl"
    lines = [
        json.dumps({"item_id": f"i{k}", "token_ids": list(p)})
        for k, p in enumerate(TWO_LENGTH_ITEMS)
    ]
    cat.write_text("\n".join(lines) + "\n")
    srv = start_server("--model-path", str(ckpt), "--catalog-jsonl", str(cat))
    with srv.client(timeout=120) as http:
        yield http, load_hf(ckpt)


def body(reasoning=None, **items) -> dict:
    rs = {
        "n": 2,
        "max_new_tokens": 6,
        "temperature": T1,
        "seed": 11,
        "stop_token_ids": [STOP],
        **(reasoning or {}),
    }
    sp = {
        "reasoning": rs,
        "forced_prefix": {"ids": PREFIX},
        "n": 3,
        "max_new_tokens": 3,
        "use_catalog": False,
        **items,
    }
    return {"input_ids": PROMPT, "return_logprob": True, "sampling_params": sp}


def test_every_behaviour_logprob_and_score_equal_transformers(served):
    http, model = served
    r = http.post("/generate", json=body())
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    groups, beams = meta["stage_groups"], meta["beam_results"]
    assert [g["index"] for g in groups] == [0, 1] and len(beams) == 6
    for b in beams:
        bm = b["meta_info"]
        g = groups[bm["group_index"]]
        ids, n_r = b["output_ids"], len(g["reasoning_ids"])
        assert ids[:n_r] == g["reasoning_ids"] and ids[n_r : n_r + 2] == PREFIX
        kinds = [(s["kind"], s["start"], s["end"]) for s in bm["stage_spans"]]
        assert kinds == [
            ("sampled", 0, n_r),
            ("forced", n_r, n_r + 2),
            ("searched", n_r + 2, len(ids)),
        ]
        lps = bm["behaviour_logprobs"]
        assert lps[n_r : n_r + 2] == [None, None]  # forced: no logprob, not a fake 0.0
        assert [e[0] for e in bm["output_token_logprobs"]] == lps
        full = PROMPT + ids
        sampled = hf_token_logprobs(model, full, len(PROMPT), T1)[:n_r]
        searched = hf_token_logprobs(model, full, len(PROMPT) + n_r + 2, 1.0)
        assert lps[:n_r] == pytest.approx(sampled, abs=1e-5)
        assert lps[n_r + 2 :] == pytest.approx(searched, abs=1e-5)
        assert bm["sequence_score"] == pytest.approx(sum(searched), abs=1e-5)
        assert bm["sampling_logprob"] == pytest.approx(sum(searched), abs=1e-5)
        assert g["reasoning_logprob"] == pytest.approx(sum(sampled), abs=1e-5)
        assert bm["group_id"] == g["group_id"]
        assert bm["weight_versions"] == [{"version": "default", "start": 0, "end": len(ids)}]
    # the reasoning ended at its stop token, or at its length
    for g in groups:
        ended = g["reasoning_ids"][-1] == STOP
        assert g["reasoning_finish_reason"] == ("stop" if ended else "length")
        # the item stage continued the sample's own KV (all but the reasoning's last token,
        # never fed), and prefilled the rest once for all its beams
        assert g["cached_tokens"] == len(PROMPT) + len(g["reasoning_ids"]) - 1


def test_equal_to_the_same_work_as_separate_requests(served):
    http, _ = served
    meta = http.post("/generate", json=body()).json()["meta_info"]
    for g in meta["stage_groups"]:
        i = g["index"]
        one = http.post(
            "/generate",
            json={
                "input_ids": PROMPT,
                "return_logprob": True,
                "sampling_params": {
                    "max_new_tokens": 6,
                    "temperature": T1,
                    "seed": 11 + i,
                    "stop_token_ids": [STOP],
                    "use_catalog": False,
                },
            },
        ).json()
        assert one["output_ids"] == g["reasoning_ids"]
        two = http.post(
            "/generate",
            json={
                "input_ids": PROMPT + g["reasoning_ids"] + PREFIX,
                "return_logprob": True,
                "sampling_params": {"n": 3, "max_new_tokens": 3, "use_catalog": False},
            },
        ).json()
        mine = [b for b in meta["beam_results"] if b["meta_info"]["group_index"] == i]
        n = len(g["reasoning_ids"]) + 2
        assert [b["output_ids"][n:] for b in mine] == [
            b["output_ids"] for b in two["meta_info"]["beam_results"]
        ]
        assert [b["meta_info"]["sequence_score"] for b in mine] == pytest.approx(
            [b["meta_info"]["sequence_score"] for b in two["meta_info"]["beam_results"]], abs=1e-6
        )


def test_best_only_verl_gr_spelling_and_custom_params(served):
    http, _ = served
    all_beams = http.post("/generate", json=body({"n": 1})).json()
    best = http.post("/generate", json=body({"n": 1}, beam_return_mode="best_only")).json()
    assert len(best["meta_info"]["beam_results"]) == 1
    assert best["output_ids"] == all_beams["meta_info"]["beam_results"][0]["output_ids"]
    # verl-GR's keys, as verl-GR sends them (inside custom_params too): the same work
    verl = {
        "temperature": T1,
        "seed": 11,
        "stop_token_ids": [STOP],
        "use_catalog": False,
        "beam_width": 3,
        "beam_return_mode": "all_beams",
        "beam_search_params": {"max_tokens": 3, "length_penalty": 0.0},
        "decode_config": {"reasoning": {"max_tokens": 6}},
        "forced_prefix": {"ids": PREFIX},
    }
    for sp in (verl, {"custom_params": verl}):
        got = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
        assert [b["output_ids"] for b in got["meta_info"]["beam_results"]] == [
            b["output_ids"] for b in all_beams["meta_info"]["beam_results"]
        ]


def test_catalog_items_and_stochastic_beams(served):
    http, _ = served
    r = http.post("/generate", json=body(use_catalog=True, temperature=1.0, n=3, seed=5))
    meta = r.json()["meta_info"]
    items = {tuple(p) for p in TWO_LENGTH_ITEMS}
    for b, row in zip(meta["beam_results"], meta["item_results"], strict=True):
        bm = b["meta_info"]
        # the prefix ends in 10, which begins items: the item stage resumes inside them (the
        # catalog's rule), so the searched tokens end a whole item that the prefix begins
        item = b["output_ids"][bm["stage_spans"][-1]["start"] :]
        assert tuple(row["token_ids"]) in items and row["is_complete"]
        assert row["token_ids"] == [10, *item]
        assert bm["finish_reason"]["item_id"] == row["item_id"]
        assert bm["gumbel_key"] is not None
    for g in meta["stage_groups"]:
        assert "gumbel_threshold" in g


def test_beam_groups_are_computed_once_and_served_by_index(served):
    http, _ = served
    sp = {
        "temperature": 1.0,
        "max_new_tokens": 5,
        "beam_width": 4,
        "use_catalog": False,
        "beam_return_mode": "all_beams",
        "beam_search_params": {"max_tokens": 2},
        "forced_prefix": {"ids": PREFIX},
        "beam_group_id": "grp-a",
    }
    replies = [
        http.post(
            "/generate", json={"input_ids": PROMPT, "sampling_params": {**sp, "beam_index": i}}
        ).json()
        for i in range(4)
    ]
    # no seed: a second computation would sample another reasoning
    reasonings = {tuple(r["meta_info"]["stage_groups"][0]["reasoning_ids"]) for r in replies}
    assert len(reasonings) == 1
    assert [r["meta_info"]["beam_index"] for r in replies] == [0, 1, 2, 3]
    assert len({tuple(r["output_ids"]) for r in replies}) == 4
    # served width times: gone, so the id may name a new request
    other = http.post("/generate", json={"input_ids": PROMPT + [5], "sampling_params": sp})
    assert other.status_code == 200
    clash = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    assert clash.status_code == 409, clash.text


@pytest.mark.parametrize(
    "sp, says",
    [
        ({"reasoning": {}, "decode_config": {}}, "one spelling"),
        ({"reasoning": {}, "forced_prefix": {"ids": [1], "text": "t1"}}, "one of text or ids"),
        ({"reasoning": {}, "beam_index": 1}, "beam_index needs beam_group_id"),
        ({"reasoning": {"n": 2}, "beam_group_id": "g"}, "reasoning.n must be 1"),
        ({"decode_config": {}, "n": 2}, "n must be 1"),
        ({"enable_two_stage_rollout": False, "beam_search_params": {}}, "false"),
        ({"reasoning": {"temperature": -1}}, "reasoning"),
        ({"reasoning": {"n": 10**9}}, "reasoning"),
        ({"beam_group_id": "x" * 300}, "beam_group_id"),
    ],
)
def test_bad_multi_stage_bodies_are_400(served, sp, says):
    http, _ = served
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    assert r.status_code == 400 and says in r.text, r.text


def test_only_generate_serves_them(served):
    http, _ = served
    r = http.post("/submit", json=body())
    assert r.status_code == 400 and "/generate" in r.text
