"""Every output token carries the weight version that chose it, through each way a request can
straddle a weight change: an in_place pause with a write, a relabel while it runs, a retract
with or without a write before it resumes, an abort. Stepped by hand, so the change lands after
a known number of tokens (the first step chooses two: the prefill's token and one decode)."""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.weights import apply
from tests.support.reference import hf_and_ours, hf_generate

PROMPT = tuple(range(7, 29))
MAX_NEW = 6


@pytest.fixture(scope="module")
def pair():
    """Weights A (seed 21) and B (seed 22): transformers' models, and ours holding A."""
    hf_a, ours = hf_and_ours(seed=21)
    hf_b, _ = hf_and_ours(seed=22)
    return hf_a, hf_b, ours


@pytest.fixture
def engine(pair):
    hf_a, _, ours = pair
    apply.load_tensors(ours, list(hf_a.state_dict().items()), require_full=True)
    return Engine(ours, EngineConfig(weight_version="A", enable_prefill_cache=True))


def request(n: int = 1, **kw) -> GenerateRequest:
    return GenerateRequest(PROMPT, SamplingParams(max_new_tokens=MAX_NEW, n=n, **kw))


def run_all(eng: Engine) -> None:
    while eng.run_step():
        pass


def write(eng: Engine, hf, label: str) -> None:
    """A whole-model write of `hf`'s weights, as an update does it."""
    with eng.exclusive():
        apply.load_tensors(eng.model, list(hf.state_dict().items()), require_full=True)
        eng.weights_written(label, mix=None)


def unpaused(eng: Engine, req: GenerateRequest):
    rid = eng.submit(req)
    run_all(eng)
    return eng.result(rid)


def beams_of(result) -> list[list[int]]:
    return [b.output_ids for b in result.beams]


def test_in_place_with_a_write_labels_each_token_by_its_step(engine, pair):
    _, hf_b, _ = pair
    rid = engine.submit(request(n=4))
    engine.run_step()  # tokens 0 and 1 under A
    engine.pause("in_place")
    write(engine, hf_b, "B")
    engine.resume()
    run_all(engine)
    res = engine.result(rid)
    assert res.token_versions == ["A", "A"] + ["B"] * (MAX_NEW - 2)
    assert res.weight_versions == ["A", "B"] and res.weight_version == "B"
    assert res.version_spans(len(res.output_ids)) == [("A", 0, 2), ("B", 2, MAX_NEW)]
    assert (res.num_retractions, res.kv_recomputed_at) == (0, [])


def test_a_relabel_while_running_labels_the_tokens_after_it(engine):
    reference = beams_of(unpaused(engine, request(n=3)))
    rid = engine.submit(request(n=3))
    engine.run_step()
    engine.run_step()  # three tokens under A
    assert engine.relabel("A2", mix=None) == 0
    run_all(engine)
    res = engine.result(rid)
    assert beams_of(res) == reference  # a label changes no weight
    assert res.token_versions == ["A"] * 3 + ["A2"] * (MAX_NEW - 3)


def test_retract_and_a_relabel_continue_on_the_kept_kv(engine):
    reference = unpaused(engine, request(n=4))
    rid = engine.submit(request(n=4))
    engine.run_step()
    engine.pause("retract")
    assert engine.flush_cache() == (True, 1)  # retracted: the flush goes through
    engine.relabel("A2", mix=None)  # no write: the KV it kept is still these weights'
    engine.resume()
    run_all(engine)
    res = engine.result(rid)
    assert beams_of(res) == beams_of(reference)
    assert [b.sequence_score for b in res.beams] == [b.sequence_score for b in reference.beams]
    assert res.token_versions == ["A", "A"] + ["A2"] * (MAX_NEW - 2)
    assert (res.num_retractions, res.kv_recomputed_at) == (1, [])
    # kept, not recomputed: only the reference's prefill computed anything
    assert res.cached_tokens == len(PROMPT) - 1  # an exact repeat: SGLang counts all but one
    assert engine.status()["scheduler"]["prefill_tokens"] == len(PROMPT)


@pytest.mark.parametrize("kept", [2, 4])
def test_retract_and_a_write_recompute_the_kept_tokens_under_the_new_weights(engine, pair, kept):
    """Greedy: the first `kept` tokens are A's; after the write, the request continues as
    transformers' B continues the prompt followed by those tokens."""
    hf_a, hf_b, _ = pair
    rid = engine.submit(request())
    engine.run_step()  # two tokens
    for _ in range(kept - 2):
        engine.run_step()
    engine.pause("retract")
    write(engine, hf_b, "B")
    engine.resume()
    run_all(engine)
    res = engine.result(rid)
    head = hf_generate(hf_a, PROMPT, kept)
    tail = hf_generate(hf_b, PROMPT + tuple(head), MAX_NEW - kept)
    assert res.output_ids == head + tail
    assert res.token_versions == ["A"] * kept + ["B"] * (MAX_NEW - kept)
    assert (res.num_retractions, res.kv_recomputed_at) == (1, [kept])
    assert res.finish_reason == "length"


def test_a_recomputed_beam_search_keeps_its_beams_and_continues_them(engine, pair):
    """Beams reorder across the recompute: each beam's token at position t still reports the
    version of step t, and the recomputed tails are exactly the KV B gives each beam's path."""
    hf_a, hf_b, _ = pair
    rid = engine.submit(request(n=4))
    engine.run_step()
    engine.run_step()  # three tokens under A
    seq = engine.scheduler.get(rid)
    before = seq.beams.running_paths().clone()
    engine.pause("retract")
    write(engine, hf_b, "B")
    assert not seq.holds_kv
    engine.resume()
    engine.run_step()  # recompute, then token 3 under B
    assert seq.kv_recomputed_at == [3]
    # the recomputed tail of beam j is B's KV of the prompt and beam j's first two tokens
    # (fed at slots 0 and 1), which the new running beams continue
    parents = seq.beams.parents()
    hf_b_out = hf_b(torch.tensor([list(PROMPT) + before[parents[0]].tolist()]), use_cache=True)
    k_layer0 = hf_b_out.past_key_values.layers[0].keys[0]  # [KV, S, D] after RoPE, B's
    ours = seq.beam_kv.data[0, 0, 0, :, :2]  # layer 0 keys of beam 0's two fed tokens
    torch.testing.assert_close(ours, k_layer0[:, len(PROMPT) : len(PROMPT) + 2], atol=1e-4, rtol=0)
    run_all(engine)
    res = engine.result(rid)
    assert len(res.beams) == 4
    for b in res.beams:
        assert res.token_versions[: len(b.output_ids)] == ["A"] * 3 + ["B"] * (
            len(b.output_ids) - 3
        )
        assert b.output_ids[:3] in before.tolist()  # a descendant of a kept beam


def test_beams_ending_early_report_only_their_own_positions(engine, pair):
    """A beam that stops at a stop token is shorter than the top one: its spans end at its
    length."""
    _, hf_b, _ = pair
    free = unpaused(engine, request(n=4))
    stop = free.beams[1].output_ids[2]  # the third token of a beam: some beam ends there
    rid = engine.submit(request(n=4, stop_token_ids=(stop,)))
    engine.run_step()
    engine.pause("in_place")
    write(engine, hf_b, "B")
    engine.resume()
    run_all(engine)
    res = engine.result(rid)
    lengths = sorted({len(b.output_ids) for b in res.beams})
    assert len(lengths) > 1, lengths
    for b in res.beams:
        n = len(b.output_ids)
        assert res.version_spans(n) == [("A", 0, 2)] + ([("B", 2, n)] if n > 2 else [])


def test_an_abort_after_a_write_reports_the_tokens_it_has(engine, pair):
    _, hf_b, _ = pair
    rid = engine.submit(request(n=2))
    engine.run_step()
    engine.pause("in_place")
    write(engine, hf_b, "B")
    engine.resume()
    engine.run_step()
    assert engine.cancel(rid)
    res = engine.result(rid)
    assert res.finish_reason == "abort" and len(res.output_ids) == 3
    assert res.token_versions == ["A", "A", "B"]
    assert res.version_spans(3) == [("A", 0, 2), ("B", 2, 3)]


def test_a_retracted_request_aborted_before_it_resumes_keeps_its_tokens(engine, pair):
    _, hf_b, _ = pair
    rid = engine.submit(request(n=2))
    engine.run_step()
    engine.pause("retract")
    write(engine, hf_b, "B")
    assert engine.pause("abort") == 1
    res = engine.result(rid)
    assert res.finish_reason == "abort" and len(res.output_ids) == 2
    assert res.token_versions == ["A", "A"] and res.num_retractions == 1


def test_no_token_one_empty_span_of_the_current_version(engine):
    engine.pause("in_place")
    engine.resume()
    rid = engine.submit(request())
    assert engine.cancel(rid)
    res = engine.result(rid)
    assert res.output_ids == [] and res.version_spans(0) == [("A", 0, 0)]
