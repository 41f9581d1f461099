"""The sampling support within the memory budget (return_sampling_mask, slime's
return_top_p_token_ids): a step builds its table for the rows of the requests that ask only, no
wider than the vocabulary (never --sampling-mask-max-tokens + 1 columns on a 128-token one);
each asking request keeps its own rows, never the step's table (a short request's rows are not
held by a long one's history); what it keeps counts in --max-kv-bytes; and the support is
transformers' own distribution, alone or batched."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.kv_cache import sampling_mask_bytes
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.engine.search.row_tops import RowTops
from grctl.errors import ValidationError
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

PROMPT = tuple(range(5, 25))
CAP = 4096  # --sampling-mask-max-tokens' default


@pytest.fixture(scope="module")
def pair():
    return hf_and_ours(seed=13)


def ask(width: int, new: int, mask: bool, prompt=PROMPT, seed=3) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=new, n=width, temperature=1.0, seed=seed, ignore_eos=True)
    return GenerateRequest(prompt, sp, return_logprob=True, return_sampling_mask=mask)


def test_only_the_rows_that_ask_hold_a_support_no_wider_than_the_vocabulary(pair, monkeypatch):
    _, model = pair
    vocab = model.config.vocab_size
    assert vocab == 128 < CAP
    tables, empty = [], RowTops.empty.__func__

    def spy(cls, blocks, rows, *args):
        out = empty(cls, blocks, rows, *args)
        tables.append((rows, None if out.mask is None else tuple(out.mask[0].shape)))
        return out

    monkeypatch.setattr(RowTops, "empty", classmethod(spy))
    eng = Engine(model, EngineConfig())
    asking, wide = ask(2, 6, True), ask(16, 3, False, PROMPT[:11])
    rids = [eng.submit(r) for r in (asking, wide)]
    eng.run_step()
    eng.run_step()  # a decode step of both: 2 + 16 rows
    seq = eng.scheduler.get(rids[0])
    assert tables[-1] == (18, (2, vocab))  # the 2 rows that ask, 128 columns (not 18 x 4097)
    assert not hasattr(seq.beams.state, "rows_mask")  # the shared step state holds no support
    while eng.run_step():
        pass
    kept = seq.beams.mask_history
    assert [tuple(v.shape) for v, _ in kept] == [(1, vocab)] + [(2, vocab)] * 5
    for values, ids in kept:  # its own copy, not a view of a step's table
        assert values.untyped_storage().nbytes() == values.numel() * 4
        assert ids.untyped_storage().nbytes() == ids.numel() * 8
    assert eng.result(rids[1]).beams[0].sampling_mask is None


def test_the_support_counts_in_the_kv_budget(pair):
    _, model = pair
    vocab = model.config.vocab_size
    probe = Engine(model, EngineConfig())
    plain, asking = ask(8, 16, False), ask(8, 16, True)
    extra = probe.kv_bytes_of(asking) - probe.kv_bytes_of(plain)
    assert extra == sampling_mask_bytes(8, 16, vocab, CAP) == 12 * 8 * vocab * 16
    small = Engine(model, EngineConfig(sampling_mask_max_tokens=15))
    assert small.kv_bytes_of(asking) - small.kv_bytes_of(plain) == 12 * 8 * 16 * 16
    greedy = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=16), return_sampling_mask=True)
    assert probe.kv_bytes_of(greedy) == probe.kv_bytes_of(GenerateRequest(PROMPT, greedy.sampling))
    eng = Engine(model, EngineConfig(max_kv_bytes=probe.kv_bytes_of(plain) + extra // 2))
    eng.submit(plain)
    with pytest.raises(ValidationError, match="KV budget"):
        eng.submit(asking)


@torch.no_grad()
def test_the_support_is_the_models_distribution_alone_or_batched(pair):
    hf, model = pair
    asking = ask(3, 4, True, seed=7)
    alone = run_requests(Engine(model, EngineConfig()), [asking])[0]
    batched = run_requests(
        Engine(model, EngineConfig()), [ask(16, 2, False, PROMPT[:9]), asking, ask(1, 6, True)]
    )[1]
    for beam, other in zip(alone.beams, batched.beams, strict=True):
        assert beam.output_ids == other.output_ids
        assert beam.sampling_mask == other.sampling_mask
        ids = list(PROMPT) + beam.output_ids
        logits = hf(torch.tensor([ids])).logits[0, len(PROMPT) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).sort(-1, descending=True)
        assert beam.sampling_mask == want.indices.tolist()  # T = 1: every token, best first
        got = [v for row in beam.sampling_mask_logprobs for v in row]
        assert got == pytest.approx(want.values.flatten().tolist(), abs=1e-4)
