"""What a recommender asks of the search beyond the catalog: excluded items (the user's history),
item_results naming each item once, min_new_tokens, min_p and length_penalty, held to an
independent reference (the catalog without the excluded items, transformers' generate)."""

from __future__ import annotations

import json

import pytest
import torch

from grctl.catalog.store import CatalogStore
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from tests.engine.test_catalog_search import random_catalog
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

VOCAB = 128
PROMPT = (9, 4, 77, 31, 2, 50, 8)


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=5)


def engine_of(ours, rows=None, tmp_path=None, name="c.jsonl") -> Engine:
    eng = Engine(ours, EngineConfig(max_beam_width=64, max_running_requests=512))
    if rows is not None:
        path = tmp_path / name
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        store = CatalogStore(torch.device("cpu"), VOCAB)
        store.load(str(path))
        eng.catalogs = store
    return eng


@pytest.mark.parametrize(("seed", "width", "num_excluded"), [(0, 8, 10), (1, 16, 25), (2, 4, 3)])
def test_excluded_items_equal_the_catalog_without_them(pair, tmp_path, seed, width, num_excluded):
    """Excluding items is searching the catalog they are not in: the same beams, the same
    scores (the trie mask, not a per-token suppression that would waste beams on dead ends)."""
    _, ours = pair
    rows = random_catalog(seed, 60, (3,), codes=4, collide=6)
    full = engine_of(ours, rows, tmp_path, "full.jsonl")
    sp = SamplingParams(n=width, max_new_tokens=3)
    (best,) = run_requests(full, [GenerateRequest(PROMPT, sp)])
    # the items the unconstrained search likes best, and a few others
    named = [i for r in best.item_results for i in r.item_ids]
    excluded = list(dict.fromkeys(named[: num_excluded - 2] + [rows[0]["item_id"], 10_001]))
    # a catalog mixing int and string ids spells them all as strings (so does item_results)
    spelled = {str(i) for i in excluded}
    kept = [r for r in rows if str(r["item_id"]) not in spelled]
    reduced = engine_of(ours, kept, tmp_path, "kept.jsonl")
    ex = SamplingParams(n=width, max_new_tokens=3, exclude_item_ids=tuple(excluded))
    (got,) = run_requests(full, [GenerateRequest(PROMPT, ex)])
    (want,) = run_requests(reduced, [GenerateRequest(PROMPT, sp)])
    assert [b.output_ids for b in got.beams] == [b.output_ids for b in want.beams]
    assert [b.sequence_score for b in got.beams] == pytest.approx(
        [b.sequence_score for b in want.beams], abs=1e-5
    )
    listed = {i for r in got.item_results for i in r.item_ids}
    assert listed and not {str(i) for i in listed} & spelled
    assert listed == {i for r in want.item_results for i in r.item_ids}


def test_exclusion_is_refused_without_a_catalog(pair):
    _, ours = pair
    eng = engine_of(ours)
    with pytest.raises(Exception, match="exclude_item_ids needs the served item catalog"):
        eng.submit(GenerateRequest(PROMPT, SamplingParams(n=2, exclude_item_ids=(1,))))


def test_item_results_name_each_item_once(pair, tmp_path):
    """An item on several paths is listed once, under its best beam; the beams stay whole."""
    _, ours = pair
    paths = [[a, b] for a in (10, 11, 12) for b in (30, 31)]
    rows = [{"item_id": "shared", "token_ids": p} for p in paths[:4]]
    rows += [{"item_id": f"own-{i}", "token_ids": p} for i, p in enumerate(paths[4:])]
    eng = engine_of(ours, rows, tmp_path)
    (res,) = run_requests(eng, [GenerateRequest(PROMPT, SamplingParams(n=6, max_new_tokens=2))])
    assert len(res.beams) == 6
    ids = [r.item_id for r in res.item_results]
    assert sorted(ids) == ["own-0", "own-1", "shared"]
    first_shared = next(
        rank for rank, b in enumerate(res.beams) if b.output_ids in paths[:4]
    )  # the best beam naming it
    assert next(r.rank for r in res.item_results if r.item_id == "shared") == first_shared


@pytest.mark.parametrize("width", [1, 4])
def test_min_new_tokens_equals_transformers(pair, width):
    hf, ours = pair
    eng = engine_of(ours)
    (free,) = run_requests(
        eng, [GenerateRequest(PROMPT, SamplingParams(n=width, max_new_tokens=5))]
    )
    stop = free.beams[0].output_ids[0]  # what the search would end on first
    sp = SamplingParams(n=width, max_new_tokens=5, stop_token_ids=(stop,), min_new_tokens=3)
    (res,) = run_requests(eng, [GenerateRequest(PROMPT, sp)])
    out = hf.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=5,
        min_new_tokens=3,
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        length_penalty=0.0,
        early_stopping=False,
        eos_token_id=stop,
        pad_token_id=stop,
        output_scores=True,
        return_dict_in_generate=True,
    )
    if width == 1:
        want = [out.sequences[0, len(PROMPT) :].tolist()]
        want = [w[: w.index(stop) + 1] if stop in w else w for w in want]
    else:
        lengths = (out.beam_indices >= 0).sum(1).tolist()
        want = [
            s[len(PROMPT) : len(PROMPT) + n]
            for s, n in zip(out.sequences.tolist(), lengths, strict=True)
        ]
    assert [b.output_ids for b in res.beams] == want
    assert all(len(b.output_ids) >= 3 for b in res.beams)


def test_min_p_draws_only_tokens_near_the_most_likely(pair):
    hf, ours = pair
    eng = engine_of(ours)
    temp = 1.5
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1].float()
    probs = torch.softmax(logits / temp, -1)  # judged on the tempered distribution (SGLang's)
    ranked = probs.sort(descending=True).values
    min_p = ((ranked[4] + ranked[5]) / 2 / ranked[0]).item()  # the 5 most likely pass
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    sp = [SamplingParams(temperature=temp, min_p=min_p, seed=s) for s in range(300)]
    drawn = {r.output_ids[0] for r in run_requests(eng, [GenerateRequest(PROMPT, p) for p in sp])}
    assert len(allowed) == 5 and drawn <= allowed and len(drawn) >= 3
    plain = [SamplingParams(temperature=temp, seed=s) for s in range(300)]
    unfiltered = {
        r.output_ids[0] for r in run_requests(eng, [GenerateRequest(PROMPT, p) for p in plain])
    }
    assert unfiltered - allowed  # without min_p the same seeds reach further


def test_length_penalty_equals_transformers(pair):
    """Finished beams ranked by score / length: transformers' length_penalty=1 with
    early_stopping="never" (the exact stopping rule), beams ending early on a stop token."""
    hf, ours = pair
    eng = engine_of(ours)
    (free,) = run_requests(eng, [GenerateRequest(PROMPT, SamplingParams(n=4, max_new_tokens=4))])
    stop = free.beams[1].output_ids[1]
    sp = SamplingParams(n=4, max_new_tokens=4, stop_token_ids=(stop,), length_penalty=1.0)
    (res,) = run_requests(eng, [GenerateRequest(PROMPT, sp)])
    out = hf.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=4,
        num_beams=4,
        num_return_sequences=4,
        do_sample=False,
        length_penalty=1.0,
        early_stopping="never",
        eos_token_id=stop,
        pad_token_id=stop,
        output_scores=True,
        return_dict_in_generate=True,
    )
    lengths = (out.beam_indices >= 0).sum(1).tolist()
    want = [
        s[len(PROMPT) : len(PROMPT) + n]
        for s, n in zip(out.sequences.tolist(), lengths, strict=True)
    ]
    assert [b.output_ids for b in res.beams] == want
    assert any(b.finish_reason == "stop" for b in res.beams)
