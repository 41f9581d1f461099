"""An aborted stochastic-beam reply is not a sample without replacement: its gumbel_threshold is
absent on the wire, while null still means the whole support was drawn (the estimate exact);
grctl.rl's whole_support_of and `grctl demo --rl`'s rollout tell the two apart."""

from __future__ import annotations

import msgspec
import pytest

from grctl.cli.rl import loop
from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.protocol.generate import GenerateResponse
from grctl.rl.estimators import whole_support_of
from grctl.server.translation.generate import to_response
from tests.support.reference import hf_and_ours

PROMPT = (5, 17, 99, 42, 3, 64)


@pytest.fixture(scope="module")
def engine():
    return Engine(hf_and_ours(seed=11)[1], EngineConfig(max_beam_width=16))


def wire(result) -> dict:
    """The reply as a client reads it: the JSON the server sends."""
    return msgspec.json.decode(msgspec.json.encode(to_response(result)))


def aborted_reply(engine: Engine) -> dict:
    sp = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=2, ignore_eos=True)
    rid = engine.submit(GenerateRequest(PROMPT, sp, return_logprob=True))
    for _ in range(3):  # the prefill and two decode steps: its beams are drawn, then aborted
        engine.run_step()
    assert engine.cancel(rid)
    while engine.run_step():
        pass
    return wire(engine.result(rid))


def test_the_wire_tells_an_abort_from_a_drawn_support(engine):
    meta = aborted_reply(engine)["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert len(meta["beam_results"]) == 4
    assert all("gumbel_key" in b["meta_info"] for b in meta["beam_results"])
    assert "gumbel_threshold" not in meta
    with pytest.raises(ValueError, match="aborted"):
        whole_support_of(meta)
    # the whole support drawn (3 tokens under top_k 3, 4 beams): null, exact
    sp = SamplingParams(n=4, max_new_tokens=1, temperature=1.0, top_k=3, seed=1)
    rid = engine.submit(GenerateRequest(PROMPT, sp))
    while engine.run_step():
        pass
    reply = wire(engine.result(rid))
    whole = reply["meta_info"]
    assert "gumbel_threshold" in whole and whole["gumbel_threshold"] is None
    assert whole_support_of(whole) is True
    # the client's struct reads the same
    typed = msgspec.json.decode(msgspec.json.encode(reply), type=GenerateResponse)
    assert whole_support_of(typed.meta_info) is True
    # and a threshold: a sample of a larger support
    sp = SamplingParams(n=2, max_new_tokens=2, temperature=1.0, seed=1)
    rid = engine.submit(GenerateRequest(PROMPT, sp))
    while engine.run_step():
        pass
    part = wire(engine.result(rid))["meta_info"]
    assert isinstance(part["gumbel_threshold"], float)
    assert whole_support_of(part) is False


def test_the_demo_drops_an_aborted_group(engine, monkeypatch):
    """`grctl demo --rl`'s rollout builds no group from an aborted reply (it used to weight
    its partial beams as an exact, whole-support group)."""
    reply = msgspec.json.decode(msgspec.json.encode(aborted_reply(engine)), type=GenerateResponse)
    sp = SamplingParams(n=2, max_new_tokens=2, temperature=1.0, seed=1)
    rid = engine.submit(GenerateRequest(PROMPT, sp, return_logprob=True))
    while engine.run_step():
        pass
    done = msgspec.json.decode(msgspec.json.encode(wire(engine.result(rid))), type=GenerateResponse)

    class Task:
        num_users = 2

        def prompt(self, user):
            return list(PROMPT)

        def reward(self, user, ids):
            return 1.0

    class Client:
        def generate_batch(self, prompts, params, return_logprob):
            return [reply, done]

    groups = loop.rollout(Client(), Task(), group=2, seed=0)
    assert [g.user for g in groups] == [1]
    assert groups[0].whole_support is False and isinstance(groups[0].threshold, float)
