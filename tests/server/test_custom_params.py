"""grctl's sampling fields inside SGLang's `sampling_params.custom_params`, the form a gateway
that rebuilds SGLang's SamplingParams (smg) passes through whole: the same reply as the fields
beside the others, refusals that name what is wrong. In process, on a tiny checkpoint with a
two-token catalog whose exact ranking transformers gives (tests/e2e/test_smg.py runs it
through the real smg)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.checkpoints import load_hf

pytestmark = pytest.mark.timeout(120)

PROMPT = [9, 4, 77, 31, 2]
FIRST, SECOND = (11, 12, 13), tuple(range(40, 48))  # 24 two-token items, ids 0..23
WIDTH = 4  # >= the three first tokens: the constrained search is exhaustive


def catalog_rows() -> list[dict]:
    paths = [[a, b] for a in FIRST for b in SECOND]
    return [{"item_id": i, "token_ids": p} for i, p in enumerate(paths)]


@torch.no_grad()
def ranking(ckpt, excluded=()) -> list[int]:
    """transformers' exact best WIDTH items (masked log-probabilities, summed), best first."""
    hf = load_hf(ckpt)
    first = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, -1], -1)
    scores = {}
    for row in catalog_rows():
        a, b = row["token_ids"]
        second = torch.log_softmax(hf(torch.tensor([[*PROMPT, a]])).logits[0, -1], -1)
        scores[row["item_id"]] = float(first[a] + second[b])
    kept = sorted((i for i in scores if i not in set(excluded)), key=lambda i: -scores[i])
    return kept[:WIDTH]


def served_items(reply: dict) -> list[int]:
    return [r["item_id"] for r in reply["meta_info"]["item_results"]]


@pytest.fixture(scope="module")
def srv(start_app, tiny_checkpoint, tmp_path_factory):
    catalog = tmp_path_factory.mktemp("custom") / "catalog.jsonl"
    catalog.write_text("\n".join(json.dumps(r) for r in catalog_rows()) + "\n")
    return start_app("--model-path", str(tiny_checkpoint), "--catalog", str(catalog))


def gen(http, sp: dict, status: int = 200) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, **sp}}
    r = http.post("/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_excluded_items_inside_custom_params(http, tiny_checkpoint):
    best = ranking(tiny_checkpoint)
    assert served_items(gen(http, {"n": WIDTH})) == best
    excluded = [best[0], best[2], 999]  # 999: in no catalog, excludes nothing
    want = ranking(tiny_checkpoint, excluded)
    inside = gen(http, {"n": WIDTH, "custom_params": {"exclude_item_ids": excluded}})
    beside = gen(http, {"n": WIDTH, "exclude_item_ids": excluded})
    assert served_items(inside) == served_items(beside) == want


@pytest.mark.parametrize(
    "fields",
    [
        {"beam_width": 6},  # SGLang's form: 6 beams searched, the best n returned
        {"length_penalty": 1.0, "use_catalog": False},
        {"use_catalog": False, "temperature": 1.0, "seed": 7},
        {"use_catalog": False, "logits_processors": [{"type": "token_suppress", "token_ids": [5]}]},
        {"exclude_item_ids": [0, 1], "spaces_between_special_tokens": False},
    ],
)
def test_custom_params_fields_act_as_the_same_fields_beside(http, fields):
    inside = gen(http, {"n": 2, "custom_params": fields})
    beside = gen(http, {"n": 2, **fields})
    for reply in (inside, beside):
        reply["meta_info"].pop("id"), reply["meta_info"].pop("e2e_latency")
        reply["meta_info"].pop("cached_tokens")
    assert inside == beside


def test_custom_params_fields_take_effect(http):
    """Each field changes the reply from the one without it (so the equalities above are not
    both the defaults)."""
    plain = gen(http, {"n": 2})
    assert gen(http, {"n": 2, "custom_params": {"beam_width": 6}})["meta_info"]["beam_width"] == 6
    free = gen(http, {"n": 1, "custom_params": {"use_catalog": False}})
    assert "item_results" in plain["meta_info"] and "item_results" not in free["meta_info"]
    top = free["output_ids"][0]
    suppressed = {
        "use_catalog": False,
        "logits_processors": [{"type": "token_suppress", "token_ids": [top]}],
    }
    assert gen(http, {"n": 1, "custom_params": suppressed})["output_ids"][0] != top
    excluded = gen(http, {"n": 2, "custom_params": {"exclude_item_ids": served_items(plain)}})
    assert not set(served_items(excluded)) & set(served_items(plain))


def test_a_field_set_twice_alike_is_accepted(http):
    once = gen(http, {"n": 2, "beam_width": 4})
    twice = gen(http, {"n": 2, "beam_width": 4, "custom_params": {"beam_width": "4"}})
    assert twice["output_ids"] == once["output_ids"]
    assert (
        gen(http, {"n": 2, "custom_params": {}})["output_ids"] == gen(http, {"n": 2})["output_ids"]
    )


@pytest.mark.parametrize(
    ("custom", "words"),
    [
        ({"bogus": 1}, ["'bogus'", "not a grctl sampling field"]),
        ({"frequency_penalty": 0.5}, ["'frequency_penalty'"]),  # SGLang's, not implemented
        ({"custom_params": {}}, ["'custom_params'"]),
        ([1, 2], ["must be an object"]),
        ("beam_width=4", ["must be an object"]),
        ({"beam_width": "wide"}, ["custom_params", "beam_width"]),
        ({"beam_width": 0}, ["custom_params", "beam_width"]),
        ({"exclude_item_ids": "3"}, ["custom_params", "exclude_item_ids"]),
    ],
)
def test_bad_custom_params_are_a_400_naming_them(http, custom, words):
    err = gen(http, {"n": 2, "custom_params": custom}, status=400)["error"]
    assert err["code"] == "validation_error"
    for word in words:
        assert word in err["message"], err


def test_a_field_set_differently_in_both_places_is_a_400(http):
    sp = {"n": 2, "beam_width": 3, "custom_params": {"beam_width": 4, "length_penalty": 0.0}}
    err = gen(http, sp, status=400)["error"]
    assert "beam_width" in err["message"] and "length_penalty" not in err["message"]
