"""A request whose beams die (fewer live paths than beams: a catalog of mixed lengths under
min_new_tokens, a processor closing every child of a prefix) returns the same reply alone and in
any batch: a dead beam's padded candidate never points into another request's rows."""

from __future__ import annotations

import pytest

from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.engine.search.logits_processors import parse_logits_processors
from tests.engine.test_catalog_search import engine_with, prompt, random_catalog, write_rows
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

MIN_NEW = 4


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(seed=5)[1]


def assert_same(got, want) -> None:
    assert got.finish_reason == want.finish_reason
    assert [b.output_ids for b in got.beams] == [b.output_ids for b in want.beams]
    assert [b.finish_reason for b in got.beams] == [b.finish_reason for b in want.beams]
    for g, w in zip(got.beams, want.beams, strict=True):
        assert g.sequence_score == pytest.approx(w.sequence_score, abs=1e-5)
        assert g.sampling_logprob == pytest.approx(w.sampling_logprob, abs=1e-5)


def mixed(i: int, sp: dict) -> SamplingParams:
    """The i-th request of a mixed batch: deterministic widths 4, 2, 8 and sampled 1 and 3."""
    kind = [(2, 0.0), (4, 0.0), (1, 1.0), (8, 0.0), (3, 1.0)][i % 5]
    return SamplingParams(n=kind[0], temperature=kind[1], seed=100 + i, **sp)


@pytest.mark.parametrize("seed", [0, 1, 8])
def test_mixed_length_items_under_min_new_tokens_alone_and_batched(model, tmp_path, seed):
    rows = random_catalog(seed, 12, (1, 2, 3, 5), codes=3)
    eng = engine_with(model, write_rows(tmp_path / "c.jsonl", rows))
    long_items = {tuple(r["token_ids"]) for r in rows if len(r["token_ids"]) >= MIN_NEW}
    sp = {"max_new_tokens": 5, "min_new_tokens": MIN_NEW}
    first = GenerateRequest(prompt(7, seed), SamplingParams(n=4, **sp))
    (alone,) = run_requests(eng, [first])
    assert all(tuple(b.output_ids) in long_items for b in alone.beams)
    # the first of two, then the first of a mixed batch of five and of a batch of 30
    for size in (2, 5, 30):
        reqs = [first] + [
            GenerateRequest(prompt(3 + i, 50 + i), mixed(i, sp)) for i in range(1, size)
        ]
        together = run_requests(eng, reqs)
        assert_same(together[0], alone)
        for req, got in zip(reqs[1:4], together[1:4], strict=True):
            assert_same(got, run_requests(eng, [req])[0])
            assert all(tuple(b.output_ids) in long_items for b in got.beams)


def test_processor_closing_prefixes_alone_and_batched(model, tmp_path):
    """A token_suppress rule removing children at depth 3 of 5-token items: the beams that
    entered those prefixes die."""
    rows = random_catalog(5, 16, (5,), codes=3)
    eng = engine_with(model, write_rows(tmp_path / "c.jsonl", rows))
    closed = sorted({r["token_ids"][3] for r in rows})[:2]
    rules = parse_logits_processors([{"type": "token_suppress", "token_ids": closed}])
    sp = {"max_new_tokens": 5, "logits_processors": rules}
    first = GenerateRequest(prompt(7, 5), SamplingParams(n=4, **sp))
    (alone,) = run_requests(eng, [first])
    assert alone.finish_reason != "abort" and alone.beams
    assert all(b.output_ids[3] not in closed for b in alone.beams)
    for size in (2, 5, 30):
        reqs = [first] + [
            GenerateRequest(prompt(4 + i, 70 + i), mixed(i, sp)) for i in range(1, size)
        ]
        together = run_requests(eng, reqs)
        assert_same(together[0], alone)
        for req, got in zip(reqs[1:4], together[1:4], strict=True):
            assert_same(got, run_requests(eng, [req])[0])
