"""Partial items resume: where a prompt's item starts (catalog/resume.py) against a set of every
item path's proper prefixes, and the resumed search against transformers' constrained beam
search continuing the same prefix."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from grctl.catalog.loader import parse_catalog
from grctl.catalog.resume import ROOT, item_start
from grctl.catalog.store import CatalogStore
from grctl.catalog.trie import Trie
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import ValidationError
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

VOCAB = 128


def leveled_rows(seed: int, num: int, depths=(3,), codes: int = 5) -> list[dict]:
    """Semantic IDs whose levels have their own token ranges (self-delimiting)."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        path = [10 + 20 * d + rng.randrange(codes) for d in range(rng.choice(depths))]
        rows.append({"item_id": i, "token_ids": path})
    return rows


def trie_of(rows) -> Trie:
    parsed = parse_catalog("\n".join(json.dumps(r) for r in rows).encode(), vocab_size=VOCAB)
    return Trie(parsed.paths, parsed.lengths, torch.device("cpu"))


def proper_prefixes(rows) -> set[tuple[int, ...]]:
    """Every proper, non-empty prefix of an item path that is no item's whole path."""
    paths = {tuple(r["token_ids"]) for r in rows}
    return {p[:d] for p in paths for d in range(1, len(p))} - paths


def expected_depth(prompt: list[int], prefixes: set, max_depth: int) -> int:
    """The reference: the suffix of the prompt that is a proper item prefix (in a
    self-delimiting catalog at most one is), else 0."""
    found = [k for k in range(1, max_depth) if tuple(prompt[-k:]) in prefixes and k <= len(prompt)]
    assert len(found) <= 1
    return found[0] if found else 0


@pytest.mark.parametrize(("seed", "depths"), [(0, (3,)), (1, (2, 3, 4)), (2, (1, 5))])
def test_the_catalog_rule_equals_the_prefix_set(seed, depths):
    rows = leveled_rows(seed, 80, depths)
    trie = trie_of(rows)
    assert trie.stats.self_delimiting
    prefixes = proper_prefixes(rows)
    paths = [r["token_ids"] for r in rows]
    rng = random.Random(seed)
    resumed = 0
    for _ in range(400):
        # a history of whole items and noise, then maybe part of an item
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))]
        for _ in range(rng.randrange(0, 3)):
            prompt += rng.choice(paths)
        path = rng.choice(paths)
        prompt += path[: rng.randrange(0, len(path) + 1)]
        prompt += [rng.randrange(VOCAB)] if rng.random() < 0.15 else []
        if not prompt:
            continue
        start = item_start(trie, prompt, None)
        depth = expected_depth(prompt, prefixes, trie.depth)
        assert start.depth == depth, prompt
        if depth:
            resumed += 1
            assert start.node == trie.walk(prompt[-depth:])
        else:
            assert start == ROOT
    assert resumed > 50  # the draw reaches both outcomes


def test_a_catalog_whose_begin_tokens_recur_starts_at_the_root_unless_pinned():
    rows = [{"item_id": "a", "token_ids": [5, 6, 7]}, {"item_id": "b", "token_ids": [6, 7, 9]}]
    trie = trie_of(rows)
    assert not trie.stats.self_delimiting  # 6 begins b and is a's second token
    # [.., 5, 6, 7] is item a, and [6, 7] also begins item b: no rule can tell, so the root
    assert item_start(trie, [1, 5, 6, 7], None) == ROOT
    assert item_start(trie, [1, 5, 6], None) == ROOT
    pinned = item_start(trie, [1, 5, 6, 7], 2)
    assert pinned.depth == 2 and pinned.node == trie.walk([6, 7])
    assert item_start(trie, [1, 5, 6], 0) == ROOT


@pytest.mark.parametrize(
    ("prompt", "k", "says"),
    [
        ([3, 10], 3, "longer than the prompt"),
        ([3, 10, 30, 50], 3, "not the start of an item path"),  # a whole item
        ([3, 10, 31], 2, "not the start of an item path"),  # leaves the trie
        ([3, 10, 30], 1, "not the start of an item path"),  # [30] begins nothing
        ([10, 30, 50, 70], 4, "not the start of an item path"),  # past the deepest path
    ],
)
def test_a_pinned_prefix_that_begins_no_item_is_refused(prompt, k, says):
    trie = trie_of([{"item_id": 0, "token_ids": [10, 30, 50]}])
    with pytest.raises(ValidationError, match=says):
        item_start(trie, prompt, k)
    assert item_start(trie, [3, 10, 30], 2).depth == 2


class _EndsItem(transformers.StoppingCriteria):
    def __init__(self, prompt_len: int, prefix: tuple, items: set):
        self.prompt_len, self.prefix, self.items = prompt_len, prefix, items

    def __call__(self, input_ids, scores, **kwargs):
        gen = input_ids[:, self.prompt_len :].tolist()
        return torch.tensor([self.prefix + tuple(g) in self.items for g in gen])


def resumed_reference(hf, prompt: list[int], depth: int, rows, width: int, max_new: int):
    """transformers' beam search over the children of (the prompt's last `depth` tokens + what
    it generated), stopping at an item: [(tokens, score)] of its real beams."""
    items = {tuple(r["token_ids"]) for r in rows}
    children: dict[tuple, set] = {}
    for p in items:
        for d in range(len(p)):
            children.setdefault(p[:d], set()).add(p[d])
    prefix, plen = tuple(prompt[len(prompt) - depth :]), len(prompt)
    if width == 1:  # greedy: the best allowed child until an item is spelled
        gen, score = [], 0.0
        with torch.no_grad():
            while prefix + tuple(gen) not in items and len(gen) < max_new:
                lp = torch.log_softmax(hf(torch.tensor([prompt + gen])).logits[0, -1], -1)
                tok = max(children[prefix + tuple(gen)], key=lambda t: lp[t].item())
                gen.append(tok)
                score += lp[tok].item()
        return [(gen, score)]

    def allowed(batch_id, seq):
        kids = children.get(prefix + tuple(seq[plen:].tolist()))
        return sorted(kids) if kids else list(range(VOCAB))

    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        length_penalty=0.0,
        early_stopping=False,
        prefix_allowed_tokens_fn=allowed,
        stopping_criteria=transformers.StoppingCriteriaList([_EndsItem(plen, prefix, items)]),
        output_scores=True,
        return_dict_in_generate=True,
    )
    lengths = (out.beam_indices >= 0).sum(1).tolist()
    seqs = [s[plen : plen + n] for s, n in zip(out.sequences.tolist(), lengths, strict=True)]
    return [(s, sc) for s, sc in zip(seqs, out.sequences_scores.tolist(), strict=True) if sc > -1e8]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    hf, ours = hf_and_ours(seed=11)
    rows = leveled_rows(4, 120, depths=(4,), codes=4)
    path = tmp_path_factory.mktemp("resume") / "items.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = CatalogStore(torch.device("cpu"), VOCAB)
    store.load(str(path))
    eng = Engine(ours, EngineConfig(max_beam_width=16))
    eng.catalogs = store
    return hf, eng, rows


@pytest.mark.parametrize("width", [1, 4])
def test_a_resumed_search_equals_transformers_continuing_the_prefix(served, width):
    hf, eng, rows = served
    items: dict[tuple, list] = {}
    for r in rows:
        items.setdefault(tuple(r["token_ids"]), []).append(r["item_id"])
    history = list(rows[7]["token_ids"])  # a whole item: not resumed
    for partial in ([], rows[3]["token_ids"][:1], rows[5]["token_ids"][:3]):
        prompt = [1, 2, 3, *history, *partial]
        (res,) = run_requests(
            eng, [GenerateRequest(tuple(prompt), SamplingParams(max_new_tokens=6, n=width))]
        )
        ref = resumed_reference(hf, prompt, len(partial), rows, width, 6)
        assert res.item_prefix_len == len(partial)
        assert [b.output_ids for b in res.beams] == [t for t, _ in ref]
        for beam, (_, score) in zip(res.beams, ref, strict=True):
            assert beam.sequence_score == pytest.approx(score, abs=1e-4)
            assert len(partial) + len(beam.output_ids) == 4  # one item, completed
        for row in res.item_results:  # the item's whole path, its resumed start included
            assert row.token_ids[: len(partial)] == partial and row.is_complete
            assert row.item_ids == items[tuple(row.token_ids)]


def test_greedy_resumed_after_each_token_gives_the_unaborted_item(served):
    """An abort after k tokens, the tokens appended (slime's partial rollout): the rest is the
    unaborted run's, and the whole is one item."""
    hf, eng, rows = served
    prompt = (1, 2, 3, 4)
    (whole,) = run_requests(eng, [GenerateRequest(prompt, SamplingParams(max_new_tokens=6))])
    assert len(whole.output_ids) == 4 and whole.finish_reason == "item_complete"
    for k in range(1, 4):
        sp = SamplingParams(max_new_tokens=6 - k)
        (rest,) = run_requests(eng, [GenerateRequest(prompt + tuple(whole.output_ids[:k]), sp)])
        assert rest.item_prefix_len == k
        assert whole.output_ids[:k] + rest.output_ids == whole.output_ids
        assert rest.item_results[0].item_ids == whole.item_results[0].item_ids
        assert rest.finish_reason == "item_complete"


def test_sampled_beams_resume_inside_the_item(served):
    hf, eng, rows = served
    paths = {tuple(r["token_ids"]) for r in rows}
    partial = rows[9]["token_ids"][:2]
    under = {p for p in paths if list(p[:2]) == partial}
    sp = SamplingParams(max_new_tokens=6, n=4, temperature=1.0, seed=3)
    (res,) = run_requests(eng, [GenerateRequest((5, 6, *partial), sp)])
    got = {tuple(partial + b.output_ids) for b in res.beams}
    assert got <= under and len(got) == min(4, len(under))  # distinct, each completes one


def test_pinning_overrides_the_rule_and_a_bad_pin_is_refused(served):
    hf, eng, rows = served
    partial = rows[3]["token_ids"][:2]
    fresh = SamplingParams(max_new_tokens=6, item_prefix_len=0)
    (res,) = run_requests(eng, [GenerateRequest((1, *partial), fresh)])
    assert res.item_prefix_len == 0 and len(res.output_ids) == 4  # a whole new item
    with pytest.raises(ValidationError, match="item_prefix_len 3"):
        eng.submit(GenerateRequest((1, *partial), SamplingParams(item_prefix_len=3)))
    free = SamplingParams(use_catalog=False, item_prefix_len=1)
    with pytest.raises(ValidationError, match="needs the served item catalog"):
        eng.submit(GenerateRequest((1, *partial), free))


@pytest.mark.parametrize("have", [1, 3])
def test_an_abort_during_the_step_that_completes_the_item_finishes_it(served, have, monkeypatch):
    """The partial rollout's race: an abort that lands while the step completing the item runs
    leaves a whole item, reported finished (a trainer would otherwise resume past it)."""
    hf, eng, rows = served
    prompt = (1, 2, 3, *rows[3]["token_ids"][:have])
    rid = eng.submit(GenerateRequest(prompt, SamplingParams(max_new_tokens=6)))
    run = eng.worker.executor.run

    def aborted_meanwhile(*args, **kwargs):
        assert eng.cancel(rid)  # the step is computing: the abort waits for its outcome
        return run(*args, **kwargs)

    monkeypatch.setattr(eng.worker.executor, "run", aborted_meanwhile)
    while eng.run_step():
        pass
    res = eng.result(rid)
    if have == 3:  # the step's one token completed the item
        assert res.finish_reason == "item_complete" and res.item_results[0].is_complete
        assert len(res.output_ids) == 1
    else:  # the step stopped short of it: aborted mid-item, its tokens kept
        assert res.finish_reason == "abort" and not res.item_results[0].is_complete
        assert 0 < len(res.output_ids) < 4 - have
