"""Stochastic beams (temperature > 0, several beams) against the exact law of sampling distinct
sequences without replacement, that law computed from transformers' Qwen3 on the same weights;
and the log-probabilities every returned beam reports, against transformers' forward."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest
import torch

from grctl.catalog.store import CatalogStore
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.engine.search.logits_processors import parse_logits_processors
from tests.support.catalogs import TWO_LENGTH_ITEMS
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

VOCAB = 128
PROMPT = (5, 17, 99, 42, 3, 64)
# a two-level catalog: 8 items under 3 first tokens
ITEMS = [(10, 30), (10, 31), (10, 32), (11, 30), (11, 33), (12, 31), (12, 34), (12, 35)]


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=11)


def engine_of(ours, catalog_path: str | None = None, **cfg) -> Engine:
    eng = Engine(
        ours,
        EngineConfig(max_beam_width=16, max_running_requests=512, max_waiting_requests=4096, **cfg),
    )
    if catalog_path is not None:
        store = CatalogStore(torch.device("cpu"), VOCAB)
        store.load(catalog_path)
        eng.catalogs = store
    return eng


def log_softmax_at(hf, ids, temperature: float = 1.0) -> torch.Tensor:
    """transformers' log_softmax(logits / T) after the prompt `ids`, [vocab]."""
    with torch.no_grad():
        logits = hf(torch.tensor([list(ids)])).logits[0, -1].float()
    return torch.log_softmax(logits / temperature, -1)


def token_logprobs(hf, ids, out, temperature: float = 1.0) -> list[float]:
    """transformers' log_softmax(logits / T) of each token of `out` after `ids`."""
    with torch.no_grad():
        logits = hf(torch.tensor([list(ids) + list(out)])).logits[0].float()
    lp = torch.log_softmax(logits[len(ids) - 1 : -1] / temperature, -1)
    return lp[torch.arange(len(out)), torch.tensor(out)].tolist()


def set_law(probs: dict[tuple, float], k: int) -> dict[frozenset, float]:
    """The exact law of the set of k distinct draws without replacement from `probs`."""
    law: Counter = Counter()
    for order in itertools.permutations(probs, k):
        p, left = 1.0, 1.0
        for x in order:
            p *= probs[x] / left
            left -= probs[x]
        law[frozenset(order)] += p
    return law


def chi_square_p(counts: Counter, law: dict, num: int) -> float:
    """Pearson's chi-square p-value, the bins with an expected count under 5 pooled."""
    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for key, p in law.items():
        exp = p * num
        if exp < 5:
            pool_obs, pool_exp = pool_obs + counts.get(key, 0), pool_exp + exp
            continue
        stat += (counts.get(key, 0) - exp) ** 2 / exp
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        df += 1
    return torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)).item()


def inclusion_z(counts: Counter, law: dict, num: int) -> float:
    """The largest |z| of any sequence's inclusion frequency against its exact probability."""
    exact, seen = Counter(), Counter()
    for s, p in law.items():
        for x in s:
            exact[x] += p
            seen[x] += counts.get(s, 0)
    return max(
        abs(seen[x] - num * p) / math.sqrt(num * p * (1 - p) + 1e-12) for x, p in exact.items()
    )


def stochastic(width: int, seed: int, **kw) -> GenerateRequest:
    logprob = kw.pop("return_logprob", False)
    return GenerateRequest(PROMPT, SamplingParams(n=width, seed=seed, **kw), return_logprob=logprob)


@pytest.mark.slow
def test_catalog_samples_follow_the_without_replacement_law(pair, tmp_path):
    hf, ours = pair
    path = tmp_path / "c.jsonl"
    rows = [{"item_id": i, "token_ids": list(t)} for i, t in enumerate(ITEMS)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    temp, width, num = 0.8, 3, 3000
    # the sampling law: each step renormalised over the trie node's children, at T
    first = log_softmax_at(hf, PROMPT, temp)
    heads = sorted({t[0] for t in ITEMS})
    p_heads = (first[heads] - first[heads].logsumexp(0)).exp().tolist()
    probs = {}
    for a, p_a in zip(heads, p_heads, strict=True):
        kids = [t for t in ITEMS if t[0] == a]
        lp_kids = log_softmax_at(hf, PROMPT + (a,), temp)[[t[1] for t in kids]]
        for t, q in zip(kids, (lp_kids - lp_kids.logsumexp(0)).exp().tolist(), strict=True):
            probs[t] = p_a * q
    law = set_law(probs, width)
    eng = engine_of(ours, str(path))
    results = run_requests(
        eng, [stochastic(width, s, max_new_tokens=2, temperature=temp) for s in range(num)]
    )
    counts = Counter()
    for res in results:
        seqs = [tuple(b.output_ids) for b in res.beams]
        assert len(seqs) == width and len(set(seqs)) == width  # distinct
        assert all(s in probs for s in seqs)  # every one a catalog item
        assert all(b.finish_reason == "item_complete" for b in res.beams)
        counts[frozenset(seqs)] += 1
    assert chi_square_p(counts, law, num) > 1e-3
    assert inclusion_z(counts, law, num) < 4.5


@pytest.mark.slow
def test_free_samples_follow_the_without_replacement_law(pair):
    """No catalog, two tokens, top_k 3 at T 1.3: 9 sequences, 3 drawn without replacement (the
    decode step's keys are conditioned on their parents' keys)."""
    hf, ours = pair
    temp, width, num, k = 1.3, 3, 3000, 3
    first = log_softmax_at(hf, PROMPT, temp)
    top_first = first.topk(k)
    probs = {}
    renorm = top_first.values - top_first.values.logsumexp(0)
    for a, lp_a in zip(top_first.indices.tolist(), renorm.tolist(), strict=True):
        second = log_softmax_at(hf, PROMPT + (a,), temp).topk(k)
        lp_b = second.values - second.values.logsumexp(0)
        for b, q in zip(second.indices.tolist(), lp_b.tolist(), strict=True):
            probs[(a, b)] = math.exp(lp_a + q)
    law = set_law(probs, width)
    eng = engine_of(ours)
    reqs = [stochastic(width, s, max_new_tokens=2, temperature=temp, top_k=k) for s in range(num)]
    counts = Counter()
    for res in run_requests(eng, reqs):
        seqs = [tuple(b.output_ids) for b in res.beams]
        assert len(set(seqs)) == width and all(s in probs for s in seqs)
        counts[frozenset(seqs)] += 1
    assert chi_square_p(counts, law, num) > 1e-3
    assert inclusion_z(counts, law, num) < 4.5


def test_seeded_distinct_and_independent_of_batchmates(pair):
    _, ours = pair
    eng = engine_of(ours)
    kw = dict(max_new_tokens=4, temperature=1.0)
    alone = run_requests(eng, [stochastic(8, 123, **kw)])[0]
    mixed = run_requests(
        eng,
        [
            stochastic(4, 5, **kw),
            GenerateRequest((1, 2, 3), SamplingParams(n=6, max_new_tokens=4)),
            stochastic(8, 123, **kw),
            stochastic(1, 9, **kw),
        ],
    )[2]
    other = run_requests(eng, [stochastic(8, 124, **kw)])[0]
    seqs = [tuple(b.output_ids) for b in alone.beams]
    assert len(seqs) == 8 and len(set(seqs)) == 8
    assert [b.output_ids for b in mixed.beams] == [list(s) for s in seqs]
    assert [tuple(b.output_ids) for b in other.beams] != seqs
    # shown best score first
    scores = [b.sequence_score for b in alone.beams]
    assert scores == sorted(scores, reverse=True)


def test_deterministic_beams_unchanged_beside_stochastic_ones(pair):
    _, ours = pair
    eng = engine_of(ours)
    det = GenerateRequest((7, 8, 9, 10), SamplingParams(n=4, max_new_tokens=3))
    (alone,) = run_requests(eng, [det])
    together = run_requests(eng, [stochastic(5, 1, max_new_tokens=3, temperature=0.9), det])[1]
    assert [b.output_ids for b in together.beams] == [b.output_ids for b in alone.beams]
    assert [b.sequence_score for b in together.beams] == pytest.approx(
        [b.sequence_score for b in alone.beams], abs=1e-6
    )


@pytest.mark.parametrize("original", [False, True])
def test_every_beam_reports_the_trainers_logprobs(pair, original):
    """T 0.7, 6 stochastic beams: each beam's logprobs are log_softmax(logits / T) (or raw with
    --return-original-logprob) of transformers' forward; sequence_score the noise-free sum."""
    hf, ours = pair
    eng = engine_of(ours, return_original_logprob=original)
    temp = 0.7
    res = run_requests(
        eng, [stochastic(6, 3, max_new_tokens=5, temperature=temp, return_logprob=True)]
    )[0]
    assert len(res.beams) == 6
    for beam in res.beams:
        ref = token_logprobs(hf, PROMPT, beam.output_ids, 1.0 if original else temp)
        assert beam.output_token_logprobs == pytest.approx(ref, abs=1e-4)
        raw = token_logprobs(hf, PROMPT, beam.output_ids)
        assert beam.sequence_score == pytest.approx(sum(raw), abs=1e-4)
    assert res.output_token_logprobs == res.beams[0].output_token_logprobs


def test_beam_width_returns_n_beams_each_with_its_logprobs(pair):
    """SGLang's form at T = 0: beam_width 6 searches 6 beams and returns the best 3, each with
    raw log_softmax logprobs; the same 3 as the first of grctl's n = 6."""
    hf, ours = pair
    eng = engine_of(ours)
    sp = SamplingParams(n=3, beam_width=6, max_new_tokens=4)
    res, full = run_requests(
        eng,
        [
            GenerateRequest(PROMPT, sp, return_logprob=True),
            GenerateRequest(PROMPT, SamplingParams(n=6, max_new_tokens=4)),
        ],
    )
    assert [b.output_ids for b in res.beams] == [b.output_ids for b in full.beams[:3]]
    for beam in res.beams:
        ref = token_logprobs(hf, PROMPT, beam.output_ids)
        assert beam.output_token_logprobs == pytest.approx(ref, abs=1e-4)
    assert res.completion_tokens == sum(len(b.output_ids) for b in res.beams)


def test_original_logprobs_are_the_models_before_catalog_and_processors(pair, tmp_path):
    """Under a catalog and a token bias the beams are constrained and re-ranked; with
    return_original_logprob each reported logprob is the model's own log_softmax(logits), not
    tempered, renormalised or biased (the default, the behaviour's: test_behaviour_logprobs)."""
    hf, ours = pair
    path = tmp_path / "c.jsonl"
    rows = [{"item_id": i, "token_ids": list(t)} for i, t in enumerate(ITEMS)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    eng = engine_of(ours, str(path))
    bias = parse_logits_processors([{"type": "token_bias", "token_bias": {"11": 3.0}}])
    for temp in (0.0, 0.6):
        sp = SamplingParams(n=4, max_new_tokens=2, temperature=temp, seed=1, logits_processors=bias)
        req = GenerateRequest(PROMPT, sp, return_logprob=True, return_original_logprob=True)
        (res,) = run_requests(eng, [req])
        assert len(res.beams) == 4
        for beam in res.beams:
            assert tuple(beam.output_ids) in ITEMS
            ref = token_logprobs(hf, PROMPT, beam.output_ids)
            assert beam.output_token_logprobs == pytest.approx(ref, abs=1e-5)


def catalog_engine(ours, tmp_path, items) -> Engine:
    path = tmp_path / "items.jsonl"
    rows = [{"item_id": i, "token_ids": list(t)} for i, t in enumerate(items)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return engine_of(ours, str(path))


def test_keys_draw_order_and_threshold(pair, tmp_path):
    """Every stochastic beam carries its key and draw order (the key order); the threshold is
    below every returned key. beam_width 6 returning 3 has the threshold of the same search's
    4th key, n = 6 that of the 7th (below all 6); a search as wide as the catalog's support, or
    wider, draws it all and has none; deterministic beams have no keys."""
    _, ours = pair
    eng = catalog_engine(ours, tmp_path, ITEMS)
    kw = dict(max_new_tokens=2, temperature=0.9)
    for seed in range(8):
        part, full, free = run_requests(
            eng,
            [
                GenerateRequest(PROMPT, SamplingParams(n=3, beam_width=6, seed=seed, **kw)),
                stochastic(6, seed, **kw),
                stochastic(4, seed, top_k=5, use_catalog=False, **kw),
            ],
        )
        for res in (part, full, free):
            keys = [b.gumbel_key for b in res.beams]
            by_key = sorted(range(len(keys)), key=lambda j: -keys[j])
            assert [res.beams[j].draw_order for j in by_key] == list(range(len(keys)))
            assert res.gumbel_threshold is not None and res.gumbel_threshold < min(keys)
            scores = [b.sequence_score for b in res.beams]
            assert scores == sorted(scores, reverse=True)  # still best score first
        full_keys = sorted((b.gumbel_key for b in full.beams), reverse=True)
        assert sorted(b.gumbel_key for b in part.beams) == sorted(full_keys[:3])
        assert part.gumbel_threshold == full_keys[3]
        assert full.gumbel_threshold < full_keys[-1]
    for width in (len(ITEMS), len(ITEMS) + 3):
        (res,) = run_requests(eng, [stochastic(width, 5, **kw)])
        assert len(res.beams) == len(ITEMS) and res.gumbel_threshold is None
    (det,) = run_requests(eng, [GenerateRequest(PROMPT, SamplingParams(n=3, max_new_tokens=2))])
    assert det.gumbel_threshold is None
    assert all(b.gumbel_key is None and b.draw_order is None for b in det.beams)


def priority_estimates(results, reward) -> list[float]:
    """Per request, the priority-sampling estimate sum over its beams of r * p / q, q = P(a
    key above the threshold) = 1 - exp(-exp(phi - threshold)), phi the beam's
    sampling_logprob (a test-local reference of the estimator)."""
    out = []
    for res in results:
        kappa = res.gumbel_threshold
        total = 0.0
        for b in res.beams:
            q = 1.0 if kappa is None else -math.expm1(-math.exp(b.sampling_logprob - kappa))
            total += reward(tuple(b.output_ids)) * math.exp(b.sampling_logprob) / q
        out.append(total)
    return out


# items of two and three tokens (a sequence may end a step early)
MIXED = TWO_LENGTH_ITEMS


@pytest.mark.slow
def test_priority_sampling_with_the_threshold_is_unbiased(pair, tmp_path):
    """The keys' law against exact enumeration: over many seeded requests, the priority-sampling
    estimate built from each beam's sampling_logprob and the request's threshold averages to
    the exact E[r] (and to total mass 1) within 3 standard errors, on a catalog whose items
    end at two lengths and on free sampling with top_k."""
    hf, ours = pair
    temp, width, num = 0.8, 3, 1200

    def exact_law(seqs_of):
        probs = {}

        def walk(prefix, lp):
            kids = seqs_of(prefix)
            if not kids:
                probs[prefix] = math.exp(lp)
                return
            row = log_softmax_at(hf, PROMPT + prefix, temp)[kids]
            for t, q in zip(kids, (row - row.logsumexp(0)).tolist(), strict=True):
                walk(prefix + (t,), lp + q)

        walk((), 0.0)
        return probs

    def children(prefix):
        n = len(prefix)
        return sorted({it[n] for it in MIXED if len(it) > n and it[:n] == prefix})

    def free(prefix):  # top_k 3 of the tempered distribution, two tokens
        if len(prefix) == 2:
            return []
        return log_softmax_at(hf, PROMPT + prefix, temp).topk(3).indices.tolist()

    cases = [
        (catalog_engine(ours, tmp_path, MIXED), children, dict(max_new_tokens=3)),
        (engine_of(ours), free, dict(max_new_tokens=2, top_k=3)),
    ]
    for eng, seqs_of, kw in cases:
        probs = exact_law(seqs_of)
        assert sum(probs.values()) == pytest.approx(1.0, abs=1e-6)
        reward = {s: (i % 4) / 3 + (len(s) == 3) for i, s in enumerate(sorted(probs))}.get
        exact = sum(p * reward(s) for s, p in probs.items())
        reqs = [stochastic(width, s, temperature=temp, **kw) for s in range(num)]
        results = run_requests(eng, reqs)
        for r, target in ((reward, exact), (lambda s: 1.0, 1.0)):
            est = torch.tensor(priority_estimates(results, r), dtype=torch.float64)
            se = est.std().item() / math.sqrt(num)
            assert abs(est.mean().item() - target) < 3 * se, (est.mean().item(), target, se)
