"""Beams at the anchors' widths (xLLM's beam 512 x top_k 512; FlashRec's n = 1,000): a search of
512 and 1,024 beams returns the same best sequences as a brute-force reference over
transformers' logits (each step: every beam's full-vocabulary log_softmax added to its score,
the best `width` of all of them), under the default width limit; and the wide selection's row
pruning (search/row_budget.py) keeps every one of a request's K best candidates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.engine.search import row_budget
from tests.support.reference import assert_beams_match, brute_force_beams, hf_and_ours

VOCAB = 2048
STEPS = 3


@pytest.mark.slow
@pytest.mark.parametrize("width", [512, 1024])
def test_wide_beams_equal_a_brute_force_reference(width):
    hf, ours = hf_and_ours(seed=11, vocab_size=VOCAB)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(width))
    prompt = prompt.tolist()
    eng = Engine(ours, EngineConfig())  # the default --max-beam-width admits it
    rid = eng.submit(
        GenerateRequest(
            tuple(prompt), SamplingParams(n=width, max_new_tokens=STEPS, ignore_eos=True)
        )
    )
    while eng.run_step():
        pass
    beams = eng.result(rid).beams
    got = [(tuple(b.output_ids), b.sequence_score) for b in beams]
    assert_beams_match(got, brute_force_beams(hf, prompt, width, STEPS))


@pytest.mark.parametrize("ahead", [0.0, 6.0, 40.0])
def test_row_pruning_keeps_every_request_best_candidate(ahead):
    """Two requests of 300 and 200 rows, K = 300 (each row ranks its best 8 for the bound):
    each request's K best scores over all its rows x vocabulary lie within what row_top keeps,
    whether the winners spread over the rows (ahead 0), one parent per request is ahead so
    that its row holds more than 8 of them but not all (6), or holds all of them (40)."""
    gen = torch.Generator().manual_seed(3)
    num_rows, k = [300, 200], 300
    x = torch.randn(500, 4096, generator=gen) * 3
    lse = torch.logsumexp(x, -1, keepdim=True)
    p = torch.randn(500, generator=gen)
    p[7] += ahead
    p[333] += ahead
    p[450] = float("-inf")  # a dead beam
    values, cols = row_budget.row_top(x, lse, p, num_rows, k)
    # spread: a few dozen per row; ahead: its row ranks what it holds; all: the top K
    width = values.shape[1]
    assert {0.0: width < 64, 6.0: 64 < width < k, 40.0: width == k}[ahead], width
    # best first in every row
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    score = p[:, None] + (x - lse)
    start = 0
    for n in num_rows:
        rows = slice(start, start + n)
        best = score[rows].flatten().topk(k).values
        kept = (p[rows, None] + (values[rows] - lse[rows])).flatten()
        assert torch.equal(kept.topk(k).values, best)
        start += n
    # the columns are where the values came from
    ok = torch.isfinite(values)
    assert torch.equal(x.gather(1, cols)[ok], values[ok])
    assert np.all(cols[~ok].numpy() == 0)
