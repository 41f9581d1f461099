"""min_new_tokens under a catalog of mixed item lengths: a prefix whose every item ends too soon
is closed as a whole, so the behaviour policy is a distribution over the items long enough (its
log-probabilities are held to transformers' softmax renormalised over the open children, worked
out here from the item list), a sample always reaches one, beam search equals transformers'
over the long items, and a request no item is reachable for ends "no_item", not "abort"."""

from __future__ import annotations

import math

import pytest
import torch

from grctl.engine.request import GenerateRequest, SamplingParams
from tests.engine.test_catalog_search import (
    engine_with,
    prompt,
    random_catalog,
    reference,
    write_rows,
)
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

MIN_NEW = 4
# items of 1, 2, 3 and 5 tokens: prefixes 10, 11, 12 and 13-32 hold only items shorter than
# MIN_NEW, 13, 14 and 15 long ones (14 a short one beside them)
PATHS = [
    (10,),
    (11, 30),
    (11, 31),
    (12, 30, 50),
    (12, 31, 51),
    (13, 30, 50, 70, 90),
    (13, 30, 51, 71, 91),
    (13, 31, 52, 72, 92),
    (13, 32, 50),
    (14, 30, 50, 70, 90),
    (14, 30, 50, 71, 92),
    (14, 31),
    (15, 33, 53, 73, 93),
]
ROWS = [{"item_id": f"i{k}", "token_ids": list(p)} for k, p in enumerate(PATHS)]


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=5)


def reachable(rows, min_len: int, excluded=()) -> set[tuple[int, ...]]:
    """The items a beam can complete (it stops at the first item on its path), long enough and
    not excluded."""
    paths = {tuple(r["token_ids"]) for r in rows}
    first = {p for p in paths if not any(p[:d] in paths for d in range(1, len(p)))}
    banned = {tuple(r["token_ids"]) for r in rows if r["item_id"] in excluded}
    # an excluded path is closed only when every item on it is excluded
    closed = {p for p in banned if all(r["item_id"] in excluded for r in rows
                                       if tuple(r["token_ids"]) == p)}  # fmt: skip
    return {p for p in first if len(p) >= min_len and p not in closed}


def behaviour_logprob(hf, ids, path, allowed: set[tuple[int, ...]]) -> float:
    """log q(path): each step's softmax over the children that still lead to an allowed item,
    renormalised (transformers' logits)."""
    total, path = 0.0, tuple(path)
    with torch.no_grad():
        for d in range(len(path)):
            lp = torch.log_softmax(hf(torch.tensor([list(ids) + list(path[:d])])).logits[0, -1], -1)
            kids = sorted({p[d] for p in allowed if p[:d] == path[:d]})
            total += (lp[path[d]] - torch.logsumexp(lp[kids], 0)).item()
    return total


@pytest.mark.parametrize(
    ("rows", "seed"), [(ROWS, 0), (ROWS, 1), (random_catalog(4, 12, (1, 2, 3, 5), codes=3), 4)]
)
def test_behaviour_policy_is_a_distribution_over_the_long_items(pair, tmp_path, rows, seed):
    hf, ours = pair
    allowed = reachable(rows, MIN_NEW)
    assert 0 < len(allowed) < len({tuple(r["token_ids"]) for r in rows})
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    ids = prompt(7, seed)
    # Gumbel beams at least as wide as the support: every allowed item, drawn once
    sp = SamplingParams(n=16, max_new_tokens=5, min_new_tokens=MIN_NEW, temperature=1.0, seed=3)
    (res,) = run_requests(eng, [GenerateRequest(ids, sp, return_logprob=True)])
    assert {tuple(b.output_ids) for b in res.beams} == allowed
    assert all(b.finish_reason == "item_complete" for b in res.beams)
    total = sum(math.exp(b.sampling_logprob) for b in res.beams)
    assert total == pytest.approx(1.0, abs=1e-5)
    for b in res.beams:
        want = behaviour_logprob(hf, ids, b.output_ids, allowed)
        assert b.sampling_logprob == pytest.approx(want, abs=1e-5)
        assert sum(b.output_token_logprobs) == pytest.approx(want, abs=1e-5)
    # one sample at a time (n = 1): always an item, never an empty "abort"
    samples = [
        GenerateRequest(
            ids, SamplingParams(max_new_tokens=5, min_new_tokens=MIN_NEW, temperature=1.0, seed=s)
        )  # fmt: skip
        for s in range(30)
    ]
    for r in run_requests(eng, samples):
        assert r.finish_reason == "item_complete" and tuple(r.output_ids) in allowed
        want = behaviour_logprob(hf, ids, r.output_ids, allowed)
        assert r.beams[0].sampling_logprob == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(("seed", "width"), [(0, 4), (1, 2), (2, 3), (3, 8)])
def test_beam_search_equals_transformers_over_the_long_items(pair, tmp_path, seed, width):
    """The search never spends a beam on a prefix it cannot finish: it is transformers'
    constrained beam search over the catalog less its too-short items."""
    hf, ours = pair
    rows = ROWS
    allowed = reachable(rows, MIN_NEW)
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    ids = prompt(7, seed)
    sp = SamplingParams(n=width, max_new_tokens=5, min_new_tokens=MIN_NEW)
    (res,) = run_requests(eng, [GenerateRequest(ids, sp)])
    ref = reference(hf, ids, [{"token_ids": list(p)} for p in allowed], width, 5)
    assert [b.output_ids for b in res.beams] == [s for s, _ in ref]
    got = [b.sequence_score for b in res.beams]
    assert got == pytest.approx([sc for _, sc in ref], abs=1e-4)


def test_exclusions_and_min_new_tokens_close_together(pair, tmp_path):
    """A prefix whose long items are all excluded is closed though short items remain under
    it: the support is the long items not excluded."""
    hf, ours = pair
    rows = ROWS
    excluded = ("i9", "i10")  # 14's long items: only (14, 31) is left under it, too short
    allowed = reachable(rows, MIN_NEW, excluded)
    assert len(allowed) == len(reachable(rows, MIN_NEW)) - 2 and not any(
        p[0] == 14 for p in allowed
    )
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    ids = prompt(7, 0)
    sp = SamplingParams(
        n=16,
        max_new_tokens=5,
        min_new_tokens=MIN_NEW,
        temperature=1.0,
        seed=4,
        exclude_item_ids=excluded,
    )
    (res,) = run_requests(eng, [GenerateRequest(ids, sp)])
    assert {tuple(b.output_ids) for b in res.beams} == allowed
    assert sum(math.exp(b.sampling_logprob) for b in res.beams) == pytest.approx(1.0, abs=1e-5)
    for b in res.beams:
        assert b.sampling_logprob == pytest.approx(
            behaviour_logprob(hf, ids, b.output_ids, allowed), abs=1e-5
        )


@pytest.mark.parametrize(("width", "temperature"), [(1, 1.0), (4, 1.0), (4, 0.0), (1, 0.0)])
def test_no_reachable_item_ends_no_item(pair, tmp_path, width, temperature):
    _, ours = pair
    rows = [r for r in ROWS if len(r["token_ids"]) < MIN_NEW]
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    sp = SamplingParams(
        n=width, max_new_tokens=5, min_new_tokens=MIN_NEW, temperature=temperature, seed=1
    )
    (res,) = run_requests(eng, [GenerateRequest(prompt(7, 0), sp)])
    assert res.finish_reason == "no_item"
    assert res.beams == [] and res.output_ids == []
    assert eng.stats.num_aborted == 0
