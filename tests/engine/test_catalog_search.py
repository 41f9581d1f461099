"""Catalog-constrained search against transformers' generate() with prefix_allowed_tokens_fn.

The reference encodes grctl's rule exactly: at each step a beam may take only a child of its trie
node (transformers' PrefixConstrainedLogitsProcessor, applied to the log-softmax, so scores are
masked, not renormalised), and a beam whose tokens spell an item stops there (a StoppingCriteria
on the candidate, no EOS token and no extra score). Beam scores are transformers' with
length_penalty=0 and early_stopping=False; beams transformers pads with -1e9 scores (fewer valid
paths than the width) are the ones grctl does not return.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from grctl.catalog.store import CatalogStore
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.engine.search.logits_processors import parse_logits_processors
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

VOCAB = 128


def random_catalog(seed: int, num_items: int, lengths=(3,), codes: int = 6, collide: int = 0):
    """Items over a few codes per level (so paths share prefixes); `collide` items reuse a path."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_items):
        depth = rng.choice(lengths)
        path = [rng.randrange(codes) + 10 + 20 * d for d in range(depth)]
        rows.append({"item_id": f"item-{i}", "token_ids": path})
    for j in range(collide):
        rows.append({"item_id": 10_000 + j, "token_ids": list(rng.choice(rows)["token_ids"])})
    return rows


def write_rows(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


class ItemComplete(transformers.StoppingCriteria):
    def __init__(self, prompt_len: int, items: set[tuple[int, ...]]):
        self.prompt_len, self.items = prompt_len, items

    def __call__(self, input_ids, scores, **kwargs):
        gen = input_ids[:, self.prompt_len :].tolist()
        return torch.tensor([tuple(g) in self.items for g in gen], device=input_ids.device)


def reference(hf, ids, rows, width: int, max_new: int, **kw):
    """transformers' constrained beam search: [(tokens, score)] of the real beams, best first."""
    items = {tuple(r["token_ids"]) for r in rows}
    children: dict[tuple[int, ...], set[int]] = {}
    for path in items:
        for d in range(len(path)):
            children.setdefault(path[:d], set()).add(path[d])
    plen = len(ids)

    def allowed(batch_id, seq):
        gen = tuple(seq[plen:].tolist())
        kids = children.get(gen)
        return sorted(kids) if kids else list(range(VOCAB))  # only -1e9 filler beams get here

    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new,
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        length_penalty=0.0,
        early_stopping=False,
        prefix_allowed_tokens_fn=allowed,
        stopping_criteria=transformers.StoppingCriteriaList([ItemComplete(plen, items)]),
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )
    lengths = (out.beam_indices >= 0).sum(1).tolist()
    seqs = [s[plen : plen + n] for s, n in zip(out.sequences.tolist(), lengths, strict=True)]
    scores = out.sequences_scores.tolist()
    return [(s, sc) for s, sc in zip(seqs, scores, strict=True) if sc > -1e8]


def greedy_reference(hf, ids, rows, max_new: int):
    """Greedy (width 1): argmax over the allowed children, stop at an item; (tokens, score)."""
    items = {tuple(r["token_ids"]) for r in rows}
    gen, score = [], 0.0
    with torch.no_grad():
        for _ in range(max_new):
            lp = torch.log_softmax(hf(torch.tensor([list(ids) + gen])).logits[0, -1].float(), -1)
            kids = {p[len(gen)] for p in items if len(p) > len(gen) and list(p[: len(gen)]) == gen}
            tok = max(kids, key=lambda t: lp[t].item())
            gen.append(tok)
            score += lp[tok].item()
            if tuple(gen) in items:
                break
    return gen, score


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=3)


def engine_with(ours, path: str, **cfg) -> Engine:
    store = CatalogStore(torch.device("cpu"), VOCAB)
    store.load(path)
    eng = Engine(ours, EngineConfig(max_beam_width=64, **cfg))
    eng.catalogs = store
    return eng


def prompt(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())


CASES = [  # (seed, items, path lengths, collisions, width, max_new_tokens)
    (0, 40, (3,), 0, 4, 3),
    (1, 60, (3,), 5, 8, 3),
    (2, 30, (1, 2, 3), 4, 8, 3),  # mixed lengths: some items are prefixes of others
    (3, 80, (2, 3, 4), 3, 16, 4),
    (4, 12, (3,), 2, 32, 3),  # fewer valid paths than the width
    (5, 200, (2, 3), 10, 64, 3),
    (6, 50, (3, 4), 0, 8, 2),  # max_new_tokens shorter than every path: incomplete beams
    (7, 40, (1, 2, 3), 2, 8, 1),  # one token: the first step (from the prefill) only
]


@pytest.mark.parametrize(("seed", "num", "lengths", "collide", "width", "max_new"), CASES)
def test_beam_search_equals_transformers_constrained(
    pair, tmp_path, seed, num, lengths, collide, width, max_new
):
    hf, ours = pair
    rows = random_catalog(seed, num, lengths, collide=collide)
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    ids = prompt(5 + seed * 7, seed)
    (res,) = run_requests(
        eng, [GenerateRequest(ids, SamplingParams(max_new_tokens=max_new, n=width))]
    )
    ref = reference(hf, ids, rows, width, max_new)
    assert [b.output_ids for b in res.beams] == [s for s, _ in ref]
    got = torch.tensor([b.sequence_score for b in res.beams])
    assert torch.allclose(got, torch.tensor([sc for _, sc in ref]), atol=1e-4)
    # every beam is a path of the catalog; complete ones name their items
    paths: dict[tuple, list] = {}
    for r in rows:
        paths.setdefault(tuple(r["token_ids"]), []).append(r["item_id"])
    assert res.catalog_version == 1 and len(res.item_results) == len(res.beams)
    for rank, (beam, item) in enumerate(zip(res.beams, res.item_results, strict=True)):
        assert item.rank == rank and item.token_ids == beam.output_ids
        assert item.score == beam.sequence_score
        key = tuple(beam.output_ids)
        assert item.is_complete == (key in paths)
        # file order; ids of mixed types (str and int here) all come back as strings
        assert item.item_ids == [str(x) for x in paths.get(key, [])]
        assert item.item_id == (item.item_ids[0] if item.item_ids else None)
        assert beam.finish_reason == ("item_complete" if key in paths else "length")
        assert any(p[: len(key)] == key for p in paths)
    if num < width:
        assert len(res.beams) < width


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_greedy_constrained_equals_reference(pair, tmp_path, seed):
    hf, ours = pair
    rows = random_catalog(seed, 30, (2, 3), collide=1)
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    ids = prompt(9, 50 + seed)
    (res,) = run_requests(eng, [GenerateRequest(ids, SamplingParams(max_new_tokens=4))])
    tokens, score = greedy_reference(hf, ids, rows, 4)
    assert res.output_ids == tokens and res.finish_reason == "item_complete"
    assert res.beams[0].sequence_score == pytest.approx(score, abs=1e-4)
    assert res.item_results[0].is_complete


def test_greedy_follows_the_chosen_childs_node(pair, tmp_path):
    """A node with fewer children than the gather width: its padded entries point into the next
    node's children, and must never be taken for the child the token chose (issue 19)."""
    hf, ours = pair
    rows = [
        {"item_id": "A", "token_ids": [30, 60, 90]},
        {"item_id": "B", "token_ids": [31, 60, 91]},
        {"item_id": "C", "token_ids": [31, 61, 92]},
    ]
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    bias = parse_logits_processors([{"type": "token_bias", "token_bias": {"30": 100.0}}])
    sp = SamplingParams(max_new_tokens=3, logits_processors=bias)
    (res,) = run_requests(eng, [GenerateRequest(prompt(6, 1), sp)])
    assert res.output_ids == [30, 60, 90] and res.finish_reason == "item_complete"
    assert res.item_results[0].item_ids == ["A"]


def test_greedy_over_many_items_spells_items(pair, tmp_path):
    """Greedy n == 1 over 2,000 random 3-level items: every output is the reference's item."""
    hf, ours = pair
    rng = random.Random(5)
    rows = [
        {"item_id": i, "token_ids": [40 * d + rng.randrange(40) for d in range(3)]}
        for i in range(2000)
    ]
    ids_of: dict[tuple, list] = {}
    for r in rows:
        ids_of.setdefault(tuple(r["token_ids"]), []).append(r["item_id"])
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    prompts = [prompt(4 + i % 7, 700 + i) for i in range(24)]
    # random prompts over the items' tokens: one may end in the start of an item, which the
    # catalog's rule would complete (tests/catalog/test_resume.py); these are new items
    fresh = SamplingParams(max_new_tokens=3, item_prefix_len=0)
    results = run_requests(eng, [GenerateRequest(p, fresh) for p in prompts])
    for p, res in zip(prompts, results, strict=True):
        tokens, score = greedy_reference(hf, p, rows, 3)
        assert res.output_ids == tokens
        assert res.item_results[0].item_ids == ids_of[tuple(tokens)]
        assert res.beams[0].sequence_score == pytest.approx(score, abs=1e-4)


def test_processors_with_catalog_equal_transformers(pair, tmp_path):
    """token_bias and token_suppress on the log-probabilities, with the trie mask."""
    hf, ours = pair
    rows = random_catalog(9, 60, (3,))
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    ids = prompt(12, 9)
    free = run_requests(eng, [GenerateRequest(ids, SamplingParams(max_new_tokens=3, n=4))])[0]
    banned, boosted = free.beams[0].output_ids[1], free.beams[3].output_ids[0]
    specs = [
        {"type": "bad_tokens", "token_ids": [banned]},
        {"type": "token_bias", "token_bias": {str(boosted): 0.75}},
    ]
    sp = SamplingParams(max_new_tokens=3, n=4, logits_processors=parse_logits_processors(specs))
    (res,) = run_requests(eng, [GenerateRequest(ids, sp)])
    ref = reference(hf, ids, rows, 4, 3, suppress_tokens=[banned], sequence_bias={(boosted,): 0.75})
    assert [b.output_ids for b in res.beams] == [s for s, _ in ref]
    assert all(banned not in b.output_ids for b in res.beams)
    got = torch.tensor([b.sequence_score for b in res.beams])
    assert torch.allclose(got, torch.tensor([sc for _, sc in ref]), atol=1e-4)


def test_use_catalog_false_and_mixed_batch_equal_alone(pair, tmp_path):
    """Requests with and without the catalog, widths 1-16, decoded in the same steps."""
    hf, ours = pair
    rows = random_catalog(11, 100, (2, 3), collide=3)
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows), prefill_token_budget=64)
    reqs = []
    for i in range(10):
        sp = SamplingParams(max_new_tokens=3, n=[1, 4, 16, 8, 2][i % 5], use_catalog=i % 3 != 0)
        reqs.append(GenerateRequest(prompt(3 + i * 5, 300 + i), sp))
    together = run_requests(eng, reqs)
    assert eng.status()["scheduler"]["prefill_batches"] > 1
    for req, t in zip(reqs, together, strict=True):
        (alone,) = run_requests(eng, [req])
        assert [b.output_ids for b in t.beams] == [b.output_ids for b in alone.beams]
        for bt, ba in zip(t.beams, alone.beams, strict=True):
            assert bt.sequence_score == pytest.approx(ba.sequence_score, abs=1e-5)
        if req.sampling.use_catalog:
            assert t.catalog_version == 1 and t.item_results is not None
        else:
            assert t.catalog_version is None and t.item_results is None
    assert reqs[1].sampling.use_catalog and reqs[1].sampling.n == 4
    ref = reference(hf, reqs[1].input_ids, rows, 4, 3)
    assert [b.output_ids for b in together[1].beams] == [s for s, _ in ref]


def test_sampled_constrained_decodes_only_items(pair, tmp_path):
    """Width 1 with temperature: seeded, reproducible, and every sample is an item."""
    hf, ours = pair
    rows = random_catalog(13, 25, (2, 3))
    items = {tuple(r["token_ids"]) for r in rows}
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    ids = prompt(7, 13)
    reqs = [
        GenerateRequest(ids, SamplingParams(max_new_tokens=4, temperature=1.5, seed=s))
        for s in range(12)
    ]
    first, again = run_requests(eng, reqs), run_requests(eng, reqs[:3])
    assert all(tuple(r.output_ids) in items and r.item_results[0].is_complete for r in first)
    assert [r.output_ids for r in again] == [r.output_ids for r in first[:3]]
    assert len({tuple(r.output_ids) for r in first}) > 1


class FirstStepOnly(transformers.LogitsProcessor):
    """The reference for a processor with phases ["prefill"]: the first output token only."""

    def __init__(self, prompt_len: int, inner: transformers.LogitsProcessor):
        self.prompt_len, self.inner = prompt_len, inner

    def __call__(self, input_ids, scores):
        return self.inner(input_ids, scores) if input_ids.shape[1] == self.prompt_len else scores


def test_processor_phases_and_fill_value_equal_transformers(pair, tmp_path):
    hf, ours = pair
    rows = random_catalog(17, 60, (3,))
    eng = engine_with(ours, write_rows(tmp_path / "c.jsonl", rows))
    ids = prompt(10, 17)
    free = run_requests(eng, [GenerateRequest(ids, SamplingParams(max_new_tokens=3, n=4))])[0]
    first = free.beams[0].output_ids[0]
    specs = [{"type": "suppress_tokens", "token_ids": [first], "phases": ["prefill"]}]
    sp = SamplingParams(max_new_tokens=3, n=4, logits_processors=parse_logits_processors(specs))
    (res,) = run_requests(eng, [GenerateRequest(ids, sp)])
    suppress = transformers.SuppressTokensLogitsProcessor([first], device="cpu")
    processors = transformers.LogitsProcessorList([FirstStepOnly(len(ids), suppress)])
    ref = reference(hf, ids, rows, 4, 3, logits_processor=processors)
    assert [b.output_ids for b in res.beams] == [s for s, _ in ref]
    assert all(b.output_ids[0] != first for b in res.beams)
    got = torch.tensor([b.sequence_score for b in res.beams])
    assert torch.allclose(got, torch.tensor([sc for _, sc in ref]), atol=1e-4)
    # a finite fill_value replaces the log-probability: the token's score is exactly that
    specs = [{"type": "token_suppress", "token_ids": [first], "fill_value": -0.25}]
    sp = SamplingParams(max_new_tokens=1, n=1, logits_processors=parse_logits_processors(specs))
    (one,) = run_requests(eng, [GenerateRequest(ids, sp)])
    assert one.output_ids == [first] and one.beams[0].sequence_score == pytest.approx(-0.25)


@pytest.mark.gpu
def test_constrained_search_on_cuda_equals_cpu(tmp_path):
    """The trie's tensors on the GPU: the same beams and items as on the CPU."""
    rows = random_catalog(21, 200, (2, 3), collide=4)
    path = write_rows(tmp_path / "c.jsonl", rows)
    results = []
    for device in ("cpu", "cuda"):
        _, ours = hf_and_ours(seed=3, device=device)
        store = CatalogStore(torch.device(device), VOCAB)
        store.load(path)
        assert store.current.trie.child_tokens.device.type == device
        eng = Engine(ours, EngineConfig(device=device, max_beam_width=64, cuda_graph=False))
        eng.catalogs = store
        reqs = [
            GenerateRequest(prompt(20 + i, i), SamplingParams(max_new_tokens=3, n=16))
            for i in range(3)
        ]
        results.append(run_requests(eng, reqs))
    for cpu, gpu in zip(*results, strict=True):
        assert [b.output_ids for b in cpu.beams] == [b.output_ids for b in gpu.beams]
        assert [r.item_ids for r in cpu.item_results] == [r.item_ids for r in gpu.item_results]
