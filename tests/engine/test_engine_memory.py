"""release/resume_memory_occupation on the engine: the state machine verl drives, on the CPU.

verl's order: release [kv_cache, weights] -> (train) -> resume [weights] -> push -> flush ->
resume [kv_cache] -> generate. Released weights hold 0 bytes and come back bit-exact into the
same parameter objects; generation and weight writes are refused (503 memory_released) until
everything is back; graphs are dropped with the weights and captured again at the end.
"""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.cuda_graphs import DecodeGraphs, EagerPiece
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import Conflict, MemoryReleased, ValidationError
from tests.support.reference import hf_and_ours

PROMPT = (3, 17, 5, 99, 42)


def greedy(eng: Engine, n: int = 1) -> list[list[int]]:
    rid = eng.submit(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4, n=n)))
    while eng.run_step():
        pass
    return [b.output_ids for b in eng.result(rid).beams]


def reference_tokens(hf) -> list[int]:
    ids = torch.tensor([PROMPT])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4)
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture()
def pair():
    return hf_and_ours(seed=3, tie_word_embeddings=True)


def test_verl_cycle_frees_weights_and_brings_them_back_exactly(pair):
    hf, model = pair
    eng = Engine(model, EngineConfig(enable_prefill_cache=True))
    want = reference_tokens(hf)
    assert greedy(eng) == [want]
    params = dict(model.named_parameters(remove_duplicate=False))
    before = {n: p.detach().clone() for n, p in params.items()}
    assert eng.cache.stats()["entries"] == 1

    assert eng.release_memory(["kv_cache", "weights"]) == ["kv_cache", "weights"]
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert eng.cache.stats()["entries"] == 0
    assert "memory_released" in eng.ready_reasons()
    with pytest.raises(MemoryReleased, match="kv_cache, weights"):
        eng.submit(GenerateRequest(PROMPT, SamplingParams()))
    with pytest.raises(MemoryReleased):  # a push into 0-byte storage must never start
        with eng.exclusive():
            pass

    assert eng.resume_memory(["weights"]) == ["kv_cache"]
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[n] is params[n] for n in params)  # the same objects, the same storages
    assert model.lm_head_weight is model.embed_tokens.weight  # still tied
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    with eng.exclusive():  # weights are back: an update may run while KV is still released
        pass
    with pytest.raises(MemoryReleased, match="kv_cache"):
        eng.submit(GenerateRequest(PROMPT, SamplingParams()))

    assert eng.resume_memory(["kv_cache"]) == []
    assert eng.ready_reasons() == ["worker_not_running"]
    assert greedy(eng) == [want]


def test_tags_none_means_all_and_repeats_are_no_ops(pair):
    eng = Engine(pair[1], EngineConfig())
    weight_bytes = sum(p.numel() * p.element_size() for p in pair[1].parameters())
    assert eng.release_memory(None) == ["cuda_graph", "kv_cache", "weights"]
    assert eng.release_memory(["weights"]) == ["cuda_graph", "kv_cache", "weights"]
    memory = eng.status()["engine"]["memory"]
    assert memory["offloaded_weight_bytes"] == weight_bytes > 0
    assert eng.resume_memory([]) == []  # an empty list is all, as None
    assert eng.resume_memory(None) == []
    assert eng.status()["engine"]["memory"] == {
        "released": [],
        "offloaded_weight_bytes": 0,
        "discarded_weight_bytes": 0,  # an engine alone keeps every weight: none to re-push
    }


@pytest.mark.parametrize("tags", [["kv"], "weights", [1], ["weights", "gpu"]])
def test_bad_tags_change_nothing(pair, tags):
    eng = Engine(pair[1], EngineConfig())
    with pytest.raises(ValidationError):
        eng.release_memory(tags)
    assert not eng.memory.released


def test_release_refused_while_requests_are_in_flight(pair):
    eng = Engine(pair[1], EngineConfig())
    rid = eng.submit(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=2)))
    with pytest.raises(Conflict):
        eng.release_memory(["kv_cache"])
    assert not eng.memory.released
    while eng.run_step():
        pass
    eng.result(rid)
    eng.release_memory(["kv_cache"])


def test_graphs_are_dropped_with_the_weights_and_captured_again(pair):
    hf, model = pair
    eng = Engine(model, EngineConfig())
    graphs = DecodeGraphs(model, torch.device("cpu"), buckets=(4, 8), capture=EagerPiece)
    eng.runner.graphs = graphs
    want = greedy(eng, n=3)
    eng.release_memory(["weights"])
    assert eng.runner.graphs is None
    eng.resume_memory(["weights"])
    again = eng.runner.graphs
    assert again is not None and again is not graphs
    assert again.stats()["buckets"] == [4, 8]
    assert greedy(eng, n=3) == want
    assert again.num_replays > 0


def test_a_failed_recapture_serves_eagerly(pair):
    hf, model = pair
    eng = Engine(model, EngineConfig())
    eng.runner.graphs = DecodeGraphs(model, torch.device("cpu"), buckets=(4,), capture=EagerPiece)
    want = greedy(eng, n=3)
    eng.release_memory(["cuda_graph"])

    def no_memory_left(*_):
        raise RuntimeError("CUDA out of memory (simulated)")

    eng.memory._recapture = no_memory_left
    assert eng.resume_memory(None) == []
    assert eng.runner.graphs is None
    assert "out of memory" in eng.status()["engine"]["last_error"]
    assert greedy(eng, n=3) == want
