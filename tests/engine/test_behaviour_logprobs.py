"""The reported logprobs are the behaviour policy's: every token's log-probability under the
distribution it was drawn from or searched over, held to transformers' logits with the catalog
mask, the exclusions, the processors, min_new_tokens, the temperature and the filters applied by
this test itself; exp(the sequence log-probability) sums to 1 over a small catalog's items; the
model's own log_softmax under return_original_logprob; and SGLang's sampling mask."""

from __future__ import annotations

import json
import math

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
ITEMS = TWO_LENGTH_ITEMS
BIAS = {"11": 2.5, "31": -1.0}


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=11)


@pytest.fixture(scope="module")
def catalog_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cat") / "c.jsonl"
    rows = [{"item_id": i, "token_ids": list(t)} for i, t in enumerate(ITEMS)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def engine_of(ours, catalog_path: str | None = None, **cfg) -> Engine:
    eng = Engine(ours, EngineConfig(max_beam_width=16, max_running_requests=256, **cfg))
    if catalog_path is not None:
        store = CatalogStore(torch.device("cpu"), VOCAB)
        store.load(catalog_path)
        eng.catalogs = store
    return eng


def allowed_children(prefix: tuple, excluded: tuple = ()) -> list[int]:
    """The catalog's next tokens after `prefix`, through an item not excluded (this test's own
    trie: the items' paths)."""
    keep = [it for i, it in enumerate(ITEMS) if i not in excluded]
    return sorted({it[len(prefix)] for it in keep if it[: len(prefix)] == prefix})


_LOGITS: dict = {}


def logits_of(hf, ids: tuple) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] (float64), each sequence computed once."""
    key = (id(hf), ids)
    if key not in _LOGITS:
        with torch.no_grad():
            _LOGITS[key] = hf(torch.tensor([list(ids)])).logits[0].double()
    return _LOGITS[key]


def behaviour(
    hf,
    prompt,
    out,
    *,
    temperature=0.0,
    catalog=False,
    excluded=(),
    bias=None,
    suppress=(),
    stop=(),
    min_new_tokens=0,
    top_k=-1,
    top_p=1.0,
    min_p=0.0,
):
    """Each step's behaviour log-probabilities [vocab] (-inf off the support), from
    transformers' logits: log_softmax, the processors' edits, the catalog's or min_new_tokens'
    mask, / T (1 at T = 0), log_softmax, then at T > 0 top_k, top_p and min_p judged on that
    distribution, renormalised."""
    logits = logits_of(hf, (*prompt, *out))
    steps = []
    for t in range(len(out)):
        x = torch.log_softmax(logits[len(prompt) - 1 + t], -1)
        for tok, b in (bias or {}).items():
            x[int(tok)] += b
        for tok in suppress:
            x[tok] = -math.inf
        if catalog:
            keep = torch.full_like(x, -math.inf)
            ids = allowed_children(tuple(out[:t]), excluded)
            keep[ids] = 0.0
            x = x + keep
        if t < min_new_tokens:
            x[list(stop)] = -math.inf
        y = torch.log_softmax(x / (temperature or 1.0), -1)
        if temperature > 0:
            keep = torch.ones_like(y, dtype=torch.bool)
            order = y.argsort(descending=True)
            if 0 < top_k < y.numel():
                keep[order[top_k:]] = False
            p = y[order].exp()
            before = p.cumsum(0) - p
            keep[order[before > top_p]] = False
            if min_p > 0:
                keep &= y >= y.max() + math.log(min_p)
            y = torch.log_softmax(y.masked_fill(~keep, -math.inf), -1)
        steps.append(y)
    return steps


def check_beam(beam, ref, top_k: int = 0):
    """Every reported token logprob, the sequence's sampling_logprob and the top logprobs
    against the reference, within 1e-5."""
    want = [float(step[tok]) for step, tok in zip(ref, beam.output_ids, strict=True)]
    assert beam.output_token_logprobs == pytest.approx(want, abs=1e-5)
    assert beam.sampling_logprob == pytest.approx(sum(want), abs=1e-5)
    if top_k:
        for got, step in zip(beam.output_top_logprobs, ref, strict=True):
            finite = int(torch.isfinite(step).sum())
            values, ids = step.topk(min(top_k, finite))
            assert [t for _, t in got] == ids.tolist()
            assert [v for v, _ in got] == pytest.approx(values.tolist(), abs=1e-5)


def request(n=1, top=0, **kw) -> GenerateRequest:
    mode = kw.pop("return_original_logprob", None)
    mask = kw.pop("return_sampling_mask", False)
    return GenerateRequest(
        PROMPT,
        SamplingParams(n=n, **kw),
        return_logprob=True,
        top_logprobs_num=top,
        return_original_logprob=mode,
        return_sampling_mask=mask,
    )


@pytest.mark.parametrize("temp, top_k", [(1.0, -1), (0.7, 2)])
def test_sampled_catalog_tokens_report_the_masked_distribution(pair, catalog_file, temp, top_k):
    """n = 1 under the catalog, one item excluded, a token bias, top_k: each token's logprob is
    the test's masked, renormalised log-softmax of transformers' logits."""
    hf, ours = pair
    eng = engine_of(ours, catalog_file)
    procs = parse_logits_processors([{"type": "token_bias", "token_bias": BIAS}])
    kw = dict(max_new_tokens=3, temperature=temp, top_k=top_k, logits_processors=procs)
    reqs = [request(top=4, seed=s, exclude_item_ids=(1,), **kw) for s in range(6)]
    seen = set()
    for res in run_requests(eng, reqs):
        (beam,) = res.beams
        seen.add(tuple(beam.output_ids))
        assert tuple(beam.output_ids) in ITEMS and tuple(beam.output_ids) != ITEMS[1]
        ref = behaviour(
            hf,
            PROMPT,
            beam.output_ids,
            temperature=temp,
            catalog=True,
            excluded=(1,),
            bias=BIAS,
            top_k=top_k,
        )
        check_beam(beam, ref, top_k=4)
    assert len(seen) >= 2  # several items drawn


def test_catalog_items_probabilities_sum_to_one(pair, catalog_file):
    """T = 1, a stochastic search as wide as the catalog draws every item once: each beam's
    sampling_logprob is the test's, and their exp() sums to 1; the support was drawn whole, so
    there is no threshold. Also with two items excluded."""
    hf, ours = pair
    eng = engine_of(ours, catalog_file)
    for excluded in ((), (0, 5)):
        num = len(ITEMS) - len(excluded)
        (res,) = run_requests(
            eng,
            [request(n=num, max_new_tokens=3, temperature=1.0, seed=3, exclude_item_ids=excluded)],
        )
        got = {tuple(b.output_ids): b for b in res.beams}
        assert set(got) == {it for i, it in enumerate(ITEMS) if i not in excluded}
        total = 0.0
        for ids, beam in got.items():
            ref = behaviour(hf, PROMPT, ids, temperature=1.0, catalog=True, excluded=excluded)
            check_beam(beam, ref)
            total += math.exp(beam.sampling_logprob)
        assert total == pytest.approx(1.0, abs=1e-5)
        assert res.gumbel_threshold is None


def test_deterministic_beams_report_the_searched_distribution(pair, catalog_file):
    """T = 0 under the catalog with a bias: each beam's logprobs are the processed
    log-probabilities renormalised over the trie's children (no filter), and sampling_logprob
    their sum; sequence_score stays the model's log-probability after the processors."""
    hf, ours = pair
    eng = engine_of(ours, catalog_file)
    procs = parse_logits_processors([{"type": "token_bias", "token_bias": BIAS}])
    (res,) = run_requests(
        eng, [request(n=4, top=3, max_new_tokens=3, top_k=1, logits_processors=procs)]
    )
    assert len(res.beams) == 4
    for beam in res.beams:
        ref = behaviour(hf, PROMPT, beam.output_ids, catalog=True, bias=BIAS)
        check_beam(beam, ref, top_k=3)
        assert beam.gumbel_key is None and beam.draw_order is None
        logits = logits_of(hf, (*PROMPT, *beam.output_ids))[len(PROMPT) - 1 :]
        lp = torch.log_softmax(logits, -1)  # the model's, biased, not renormalised
        unnorm = [lp[t, tok] + BIAS.get(str(tok), 0.0) for t, tok in enumerate(beam.output_ids)]
        assert beam.sequence_score == pytest.approx(float(sum(unnorm)), abs=1e-4)


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("temp", [0.0, 1.3])
def test_free_tokens_with_filters_processors_and_min_new_tokens(pair, n, temp):
    """No catalog: a bias, a suppressed token, a stop token barred before min_new_tokens,
    top_k, top_p and min_p; greedy, sampled, deterministic and stochastic beams."""
    hf, ours = pair
    eng = engine_of(ours)
    procs = parse_logits_processors(
        [
            {"type": "token_bias", "token_bias": BIAS},
            {"type": "token_suppress", "token_ids": [7, 8]},
        ]
    )
    filters = dict(top_k=20, top_p=0.8, min_p=0.02)
    kw = dict(
        max_new_tokens=4,
        temperature=temp,
        logits_processors=procs,
        min_new_tokens=3,
        stop_token_ids=(9,),
        **filters,
    )
    results = run_requests(eng, [request(n=n, top=5, seed=s, **kw) for s in range(2)])
    for res in results:
        for beam in res.beams:
            ref = behaviour(
                hf,
                PROMPT,
                beam.output_ids,
                temperature=temp,
                bias=BIAS,
                suppress=(7, 8),
                stop=(9,),
                min_new_tokens=3,
                **(filters if temp else {}),
            )
            check_beam(beam, ref, top_k=5)


@pytest.mark.parametrize("server_default", [False, True])
def test_return_original_logprob_per_request(pair, catalog_file, server_default):
    """return_original_logprob: the model's log_softmax(logits), no temperature, mask, bias or
    filter; a request's true or false overrides the server's default, null follows it."""
    hf, ours = pair
    eng = engine_of(ours, catalog_file, return_original_logprob=server_default)
    procs = parse_logits_processors([{"type": "token_bias", "token_bias": BIAS}])
    kw = dict(max_new_tokens=3, temperature=0.8, top_k=2, seed=4, logits_processors=procs)
    for mode in (None, True, False):
        original = server_default if mode is None else mode
        for n in (1, 3):
            (res,) = run_requests(eng, [request(n=n, top=3, return_original_logprob=mode, **kw)])
            for beam in res.beams:
                if original:
                    ref = behaviour(hf, PROMPT, beam.output_ids)  # log_softmax(logits)
                else:
                    ref = behaviour(
                        hf,
                        PROMPT,
                        beam.output_ids,
                        temperature=0.8,
                        catalog=True,
                        bias=BIAS,
                        top_k=2,
                    )
                want = [float(s[t]) for s, t in zip(ref, beam.output_ids, strict=True)]
                assert beam.output_token_logprobs == pytest.approx(want, abs=1e-5)
                for got, step in zip(beam.output_top_logprobs, ref, strict=True):
                    values, ids = step.topk(min(3, int(torch.isfinite(step).sum())))
                    assert [t for _, t in got] == ids.tolist()
                # the sequence's behaviour log-probability whatever is reported
                behav = behaviour(
                    hf, PROMPT, beam.output_ids, temperature=0.8, catalog=True, bias=BIAS, top_k=2
                )
                q = sum(float(s[t]) for s, t in zip(behav, beam.output_ids, strict=True))
                assert beam.sampling_logprob == pytest.approx(q, abs=1e-5)


def test_sampling_mask_is_the_support(pair, catalog_file):
    """return_sampling_mask: each token's support (best first) and its log-probabilities under
    the catalog at T = 1 and T = 0.9 with top_k 2; at T = 0 the chosen token with 0."""
    hf, ours = pair
    eng = engine_of(ours, catalog_file)
    for n, temp, top_k in ((1, 1.0, -1), (3, 0.9, 2)):
        reqs = [
            request(
                n=n,
                max_new_tokens=3,
                temperature=temp,
                top_k=top_k,
                seed=s,
                return_sampling_mask=True,
            )
            for s in range(3)
        ]
        for res in run_requests(eng, reqs):
            for beam in res.beams:
                ref = behaviour(
                    hf, PROMPT, beam.output_ids, temperature=temp, catalog=True, top_k=top_k
                )
                assert len(beam.sampling_mask) == len(beam.output_ids)
                for mask, lps, step, tok in zip(
                    beam.sampling_mask,
                    beam.sampling_mask_logprobs,
                    ref,
                    beam.output_ids,
                    strict=True,
                ):
                    finite = int(torch.isfinite(step).sum())
                    values, ids = step.topk(finite)
                    assert mask == ids.tolist() and tok in mask
                    assert lps == pytest.approx(values.tolist(), abs=1e-5)
    (res,) = run_requests(eng, [request(n=2, max_new_tokens=3, return_sampling_mask=True)])
    for beam in res.beams:
        assert beam.sampling_mask == [[t] for t in beam.output_ids]
        assert beam.sampling_mask_logprobs == [[0.0]] * len(beam.output_ids)


def test_sampling_mask_cap(pair):
    """A support wider than --sampling-mask-max-tokens is flagged (the server answers 400);
    top_k within it lists exactly top_k tokens a step."""
    _, ours = pair
    eng = engine_of(ours, sampling_mask_max_tokens=16)
    wide, narrow = run_requests(
        eng,
        [
            request(max_new_tokens=2, temperature=1.0, seed=1, return_sampling_mask=True),
            request(max_new_tokens=2, temperature=1.0, top_k=16, seed=1, return_sampling_mask=True),
        ],
    )
    assert wide.beams[0].mask_overflow and wide.beams[0].sampling_mask is None
    assert not narrow.beams[0].mask_overflow
    assert [len(m) for m in narrow.beams[0].sampling_mask] == [16, 16]


def test_original_and_behaviour_requests_batched_together(pair, catalog_file):
    """One step holding a request with return_original_logprob and one without, both with top
    logprobs (of different widths): each gets its own kind, as when alone."""
    hf, ours = pair
    eng = engine_of(ours, catalog_file)
    kw = dict(max_new_tokens=3, temperature=0.8, top_k=2, seed=6)
    orig, own = run_requests(
        eng, [request(n=2, top=5, return_original_logprob=True, **kw), request(n=3, top=2, **kw)]
    )
    for beam in orig.beams:
        ref = behaviour(hf, PROMPT, beam.output_ids)
        for got, step in zip(beam.output_top_logprobs, ref, strict=True):
            values, ids = step.topk(5)
            assert [t for _, t in got] == ids.tolist()
            assert [v for v, _ in got] == pytest.approx(values.tolist(), abs=1e-5)
    for beam in own.beams:
        ref = behaviour(hf, PROMPT, beam.output_ids, temperature=0.8, catalog=True, top_k=2)
        check_beam(beam, ref, top_k=2)
