"""`rollout.name=grctl`'s reading of verl's config and sampling params, without verl (the module
imports where verl is absent; tests/e2e/test_verl.py runs verl's own code against a server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grctl.integrations.verl_rollout import GrctlServer, server_url


def rollout(tp: int = 1, dp: int = 1, pp: int = 1, **grctl) -> SimpleNamespace:
    return SimpleNamespace(
        tensor_model_parallel_size=tp,
        data_parallel_size=dp,
        pipeline_model_parallel_size=pp,
        prompt_length=16,
        response_length=8,
        custom={"grctl": grctl},
    )


def test_each_replica_has_its_server():
    cfg = rollout(urls=["http://a:1", "http://b:2"])
    assert [server_url(cfg, r) for r in (0, 1)] == ["http://a:1", "http://b:2"]
    assert server_url(rollout(url="http://c:3"), 0) == "http://c:3"
    with pytest.raises(ValueError, match="replica 2 has no server"):
        server_url(cfg, 2)
    with pytest.raises(ValueError, match="lists 0"):
        server_url(rollout(), 0)


@pytest.mark.parametrize("sizes", [(2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_a_replica_wider_than_one_device_is_refused(sizes):
    with pytest.raises(ValueError, match="one replica on one device"):
        server_url(rollout(*sizes, urls=["http://a:1"]), 0)


def actor(**grctl) -> GrctlServer:
    return GrctlServer("http://a:1", rollout(**grctl), 0, None)


def test_verls_sampling_params_as_grctls():
    server = actor(sampling_params={"ignore_eos": True, "temperature": 0.5})
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 3}
    sp, logprob = server.body_of([1, 2, 3], params)
    assert logprob and sp == {
        "ignore_eos": True,
        "temperature": 1.0,  # the request's own over the config's default
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 3,
    }
    assert params["max_tokens"] == 3  # verl's dict is not changed
    # SGLang's name wins over vLLM's; with neither, the rest of the response budget
    assert server.body_of([1], {"max_new_tokens": 2, "max_tokens": 5})[0]["max_new_tokens"] == 2
    assert server.body_of([1] * 4, {})[0]["max_new_tokens"] == 8
    assert server.body_of([1] * 20, {})[0]["max_new_tokens"] == 4  # 16 + 8 - 20 left
    assert server.body_of([1] * 30, {})[0]["max_new_tokens"] == 0
    assert server.body_of([1], {"logprobs": False})[1] is False
    with pytest.raises(ValueError, match="prompt logprobs"):
        server.body_of([1], {"prompt_logprobs": 1})


def test_the_server_address_is_the_urls():
    assert actor().get_server_address() == ("a", 1)
    assert GrctlServer("https://h", rollout(), 0, None).get_server_address() == ("h", 443)


def test_weights_are_collected_whole():
    """A checkpoint engine's tensors are views of a buffer it refills: copied as they come."""
    import asyncio

    import torch

    from grctl.integrations.verl_weights import collect

    buffer = torch.zeros(4)

    async def refilled():
        for i in range(3):
            buffer.fill_(float(i))
            yield f"t{i}", buffer.view(2, 2)

    got = asyncio.run(collect(refilled()))
    assert [n for n, _ in got] == ["t0", "t1", "t2"]
    assert [float(t.sum()) for _, t in got] == [0.0, 4.0, 8.0]
    plain = [("a", torch.ones(1))]
    assert asyncio.run(collect(iter(plain)))[0][1] is plain[0][1]  # a trainer's: not copied
