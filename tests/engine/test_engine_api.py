"""The Engine API the server calls: validation, ids, limits, results, cancel, exclusive, status.

Most tests do not start the worker: requests queue, and `run_step()` advances them one step at a
time, so every state is reached deterministically.
"""

from __future__ import annotations

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.errors import (
    Conflict,
    DuplicateRequestId,
    GenerateTimeout,
    NotFound,
    NotReady,
    Overloaded,
    Paused,
    ValidationError,
    WeightsInconsistent,
)
from tests.support.reference import hf_and_ours, rope_pair


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(seed=3)[1]


def make(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{"max_context_len": 256, "max_beam_width": 8, **kw}))


def req(ids=(1, 2, 3), rid=None, **sampling) -> GenerateRequest:
    return GenerateRequest(tuple(ids), SamplingParams(**sampling), request_id=rid)


def run_all(eng: Engine) -> int:
    steps = 0
    while eng.run_step():
        steps += 1
    return steps


@pytest.mark.parametrize(
    "bad",
    [
        req(ids=()),
        req(ids=(1, 128)),
        req(ids=(-1,)),
        req(ids=(True,)),
        req(ids=[1] * 250, max_new_tokens=7),
        req(max_new_tokens=-1),
        req(max_new_tokens=65),
        req(n=0),
        req(n=9),
        req(temperature=-1.0),
        req(temperature=float("nan")),
        req(top_p=0.0),
        req(top_p=1.5),
        req(top_k=0),
        req(stop_token_ids=(500,)),
        req(stop_token_ids=tuple(range(65))),  # each beam ranks 1 + stop ids per step
        req(rid=""),
        req(seed=2**70),
    ],
)
def test_submit_validates(model, bad):
    with pytest.raises(ValidationError):
        make(model).submit(bad)


def test_ids_results_and_not_found(model):
    eng = make(model)
    rid = eng.submit(req(rid="a", max_new_tokens=3))
    assert rid == "a" and eng.poll("a") is None and eng.num_in_flight() == 1
    with pytest.raises(DuplicateRequestId):
        eng.submit(req(rid="a"))
    with pytest.raises(GenerateTimeout):
        eng.result("a", timeout=0.01)
    assert run_all(eng) == 2  # prefill + first decode, then the last decode
    res = eng.poll("a")
    assert res.finish_reason == "length" and len(res.output_ids) == 3
    with pytest.raises(DuplicateRequestId):  # kept until fetched
        eng.submit(req(rid="a"))
    assert eng.result("a") is res
    for call in (eng.poll, eng.result):
        with pytest.raises(NotFound):
            call("a")
    assert eng.submit(req(rid="a")) == "a"  # reusable once fetched
    auto = eng.submit(req())
    assert auto != "a" and eng.num_in_flight() == 2


def test_waiting_queue_limit_and_ready_reasons(model):
    eng = make(model, max_waiting_requests=2)
    eng.submit(req())
    assert eng.ready_reasons() == ["worker_not_running"]
    eng.submit(req())
    with pytest.raises(Overloaded):
        eng.submit(req())
    assert "waiting_queue_full" in eng.ready_reasons()


def test_cancel_and_abort_all(model):
    eng = make(model, max_running_requests=1)
    running = eng.submit(req(max_new_tokens=10))
    eng.run_step()
    waiting = eng.submit(req(max_new_tokens=10))
    assert eng.cancel(running) and not eng.cancel("nope")
    res = eng.result(running)
    assert res.finish_reason == "abort" and len(res.output_ids) == 2
    assert res.beams[0].finish_reason == "abort"
    eng.submit(req(max_new_tokens=10))
    assert eng.abort_all() == 2 and eng.num_in_flight() == 0
    res = eng.result(waiting)
    assert res.finish_reason == "abort" and res.output_ids == [] and res.weight_versions == []


def test_exclusive_guards_updates(model):
    eng = make(model)
    with eng.exclusive() as aborted:  # nothing in flight: fine
        assert aborted == 0
    rid = eng.submit(req(max_new_tokens=5))
    eng.run_step()
    with pytest.raises(Conflict):
        with eng.exclusive():
            pass
    with eng.exclusive(abort_all_requests=True) as aborted:
        assert aborted == 1 and eng.result(rid).finish_reason == "abort"
        queued = eng.submit(req())  # submits queue; nothing computes
        assert not eng.run_step()
    assert eng.run_step() and eng.poll(queued) is not None


def test_inconsistent_weights_refuse_generation(model):
    eng = make(model)
    queued = eng.submit(req())
    with eng.exclusive(abort_all_requests=True):
        eng.weights_written(None, mix=None, torn="1 tensors hold bytes of a failed copy: x")
    assert not eng.gate.is_consistent and eng.gate.label == "default"
    assert "weights_inconsistent" in eng.ready_reasons()
    assert eng.status()["engine"]["weights_consistent"] is False
    with pytest.raises(WeightsInconsistent):
        eng.submit(req())
    assert not eng.run_step()
    eng.weights_written("v2", mix=None)
    assert eng.poll(queued).finish_reason == "abort"
    rid = eng.submit(req())
    run_all(eng)
    assert eng.result(rid).weight_versions == ["v2"]


def test_weight_versions_record_each_step(model):
    eng = make(model)
    rid = eng.submit(req(max_new_tokens=4, n=2))
    eng.run_step()  # prefill and one decode under "default"
    eng.pause("in_place")
    with eng.exclusive() as aborted:
        assert aborted == 0
        eng.weights_written("v2", mix=None)
    eng.resume()
    run_all(eng)
    res = eng.result(rid)
    assert res.weight_versions == ["default", "v2"] and res.weight_version == "v2"


def test_status_and_counters(model):
    eng = make(model)
    eng.submit(req(max_new_tokens=3, n=4))
    eng.submit(req(max_new_tokens=2))
    st = eng.status()
    assert st["scheduler"]["waiting"] == st["scheduler"]["num_waiting"] == 2
    run_all(eng)
    st = eng.status()
    assert st["scheduler"]["finished"] == 2 and st["scheduler"]["steps"] == 2
    assert st["requests"]["generated_tokens"] == 4 * 3 + 2
    assert st["requests"]["succeeded"] == 2 and st["requests"]["latency_s_sum"] > 0
    assert st["engine"]["device"] == "cpu" and st["engine"]["dtype"] == "float32"
    assert st["engine"]["worker_alive"] is False
    assert set(st["prefill_cache"]) >= {"enabled", "entries", "tokens", "hits", "misses"}


def test_status_reads_each_kv_once(model):
    """The worker drops a finished request's KV without the engine lock (Executor._decode),
    so status() may see `seq.ctx` set and then None: it reads each reference once. Here the
    release happens exactly between a truthiness check and the read that follows it."""
    eng = make(model)
    eng.submit(req(max_new_tokens=3, n=2))
    eng.run_step()  # prefill: the request runs and holds its KV
    seq = eng.scheduler.running[0]
    ctx, beam_kv = seq.ctx, seq.beam_kv

    class ReleasedWhenChecked:
        def __init__(self, real):
            self.real = real

        def __bool__(self):
            seq.release_kv()  # the worker, right after the check
            return True

        def __getattr__(self, name):
            return getattr(self.real, name)

    seq.ctx, seq.beam_kv = ReleasedWhenChecked(ctx), ReleasedWhenChecked(beam_kv)
    sched = eng.status()["scheduler"]
    assert sched["context_kv_bytes"] in (0, ctx.nbytes)
    assert sched["beam_kv_bytes"] in (0, beam_kv.nbytes)
    seq.ctx, seq.beam_kv = ctx, beam_kv
    sched = eng.status()["scheduler"]
    assert sched["context_kv_bytes"] == ctx.nbytes and sched["beam_kv_bytes"] == beam_kv.nbytes


def test_worker_lifecycle(model):
    eng = make(model)
    eng.start()
    assert eng.ready_reasons() == [] and eng.status()["engine"]["worker_alive"]
    ids = [eng.submit(req(ids=torch.arange(20).tolist(), max_new_tokens=6, n=3)) for _ in range(5)]
    eng.stop(drain=True, timeout=30)
    assert all(eng.result(i).finish_reason == "length" for i in ids)
    assert "worker_not_running" in eng.ready_reasons()
    with pytest.raises(NotReady):
        eng.submit(req())


def test_generate_timeout_cancels(model):
    eng = make(model)  # no worker: nothing will finish
    with pytest.raises(GenerateTimeout):
        eng.generate(req(rid="t"), timeout=0.01)
    assert eng.num_in_flight() == 0
    with pytest.raises(NotFound):
        eng.poll("t")


def test_paused_refuses_submit(model):
    eng = make(model)
    assert eng.pause("in_place") == 0 and eng.gate.is_paused and eng.gate.pause_mode == "in_place"
    with pytest.raises(Paused):
        eng.submit(req())
    with pytest.raises(ValidationError):
        eng.pause("sideways")
    eng.resume()
    assert not eng.gate.is_paused and eng.gate.pause_mode is None
    eng.submit(req())


def test_context_kv_is_shared_by_beams(model):
    """A wide beam holds the prompt's KV once, and per beam only its decoded tokens' KV."""
    cfg = model.config
    eng = make(model)
    prompt = list(range(100))
    for first, n in ((0, 1), (1, 8)):  # distinct prompts: the prefix cache shares nothing
        eng.submit(req(ids=[first, *prompt[1:]], max_new_tokens=4, n=n))
    eng.run_step()
    st = eng.status()["scheduler"]
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 bytes
    assert st["context_kv_bytes"] == 2 * len(prompt) * per_token
    assert st["beam_kv_bytes"] == (1 + 8) * 3 * per_token  # max_new_tokens - 1 steps


def test_context_limit_is_the_checkpoints_positions(model):
    """--max-context-len 0 takes the checkpoint's max_position_embeddings (512 here); a longer
    one is refused at start, since no position past it was trained (it used to be accepted
    and prompts past the checkpoint's positions were served)."""
    assert model.config.max_position_embeddings == 512
    assert Engine(model, EngineConfig()).max_context_len == 512
    assert make(model).max_context_len == 256
    with pytest.raises(ValidationError, match="longer than the checkpoint's 512 positions"):
        Engine(model, EngineConfig(max_context_len=513))
    eng = Engine(model, EngineConfig(max_new_tokens=64))
    with pytest.raises(ValidationError, match="context limit of 512"):
        eng.submit(req(ids=[1] * 500, max_new_tokens=13))
    assert eng.submit(req(ids=[1] * 500, max_new_tokens=12))


def test_context_limit_follows_the_rope_scaling_window():
    """A scaled RoPE declares a longer window (original x factor) than max_position_embeddings
    may say: yarn over 16 original positions x 4 covers 64 of a 32-position config."""
    scaled = rope_pair("yarn", "rope_parameters")[1]
    assert scaled.config.max_position_embeddings == 32
    assert Engine(scaled, EngineConfig()).max_context_len == 64
    with pytest.raises(ValidationError, match="64 positions"):
        Engine(scaled, EngineConfig(max_context_len=65))
