"""GRClient and AsyncGRClient against a real `grctl serve` with an API key: every route, typed
results, the server's errors as GrctlError subclasses, timeouts, and the flush retry loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from grctl.client import AsyncGRClient, ClientTimeout, ConnectionFailed, GRClient, request_body
from grctl.errors import CacheBusy, Forbidden, NotFound, Paused, Unauthorized, ValidationError
from grctl.protocol.generate import GenerateResponse
from grctl.protocol.info import ServerStatus
from grctl.protocol.weights import WeightsCheckerResponse
from tests.support.serverproc import free_port

pytestmark = pytest.mark.timeout(120)
KEY = "test-key"


@pytest.fixture(scope="module")
def srv(start_server, tiny_checkpoint):
    args = ["--model-path", str(tiny_checkpoint), "--allow-weight-update", "--api-key", KEY]
    return start_server(*args, "--max-new-tokens", "400")


@pytest.fixture
def gr(srv):
    with GRClient(srv.url, api_key=KEY) as client:
        yield client


def test_serving_routes(gr):
    assert gr.health().ok and gr.ready().ready
    out = gr.generate([1, 2, 3], max_new_tokens=3, rid="c-1")
    assert isinstance(out, GenerateResponse) and len(out.output_ids) == 3
    assert out.meta_info.id == "c-1" and out.meta_info.finish_reason.type == "length"
    beams = gr.generate([1, 2, 3], {"max_new_tokens": 2}, n=3).meta_info.beam_results
    assert (
        len(beams) == 3 and beams[0].meta_info.sequence_score >= beams[1].meta_info.sequence_score
    )
    rid = gr.submit([1, 2, 3], max_new_tokens=3).request_id
    while not (polled := gr.poll(rid)).ready:
        time.sleep(0.01)
    assert polled.response.output_ids == out.output_ids
    rid = gr.submit([1, 2, 3], max_new_tokens=3).request_id
    assert gr.result(rid, wait=30).output_ids == out.output_ids
    many = gr.submit_many([request_body([4, 5], max_new_tokens=2) for _ in range(3)])
    assert len(many.request_ids) == 3
    for request_id in many.request_ids:
        assert len(gr.result(request_id).output_ids) == 2
    long = gr.submit([1, 2, 3], max_new_tokens=400).request_id
    assert gr.cancel(long).request_id == long
    assert gr.result(long).meta_info.finish_reason.type in ("abort", "length")
    assert gr.abort_request(abort_all=True).success


def test_info_routes(gr, tiny_checkpoint):
    info = gr.server_info()
    assert info.device == "cpu" and info.dtype == "float32" and info.enable_memory_saver is False
    assert gr.model_info().model_path == str(tiny_checkpoint)
    status = gr.status()
    assert isinstance(status, ServerStatus) and "scheduler" in status.sections
    assert status.weights.weight_version == gr.get_weight_version().weight_version
    assert "gr_" in gr.metrics()
    assert gr.health_generate().ok


def test_weight_routes(gr):
    values = gr.get_weights_by_name("model.norm.weight").parameter
    assert isinstance(values, list) and len(values) == 64
    check = gr.weights_checker("checksum")
    assert isinstance(check, WeightsCheckerResponse) and check.algorithm == "sha256"
    assert "model.layers.0.self_attn.q_proj.weight" in check.tensors
    before = gr.get_weight_version()
    assert gr.update_weight_version("relabelled").new_version == "relabelled"
    after = gr.get_weight_version()
    assert after.weight_version == "relabelled"
    gr.update_weight_version(before.weight_version)


def test_errors_are_typed(srv, gr):
    with pytest.raises(ValidationError):
        gr.generate(None, max_new_tokens=1)  # no input_ids
    with pytest.raises(NotFound):
        gr.get_weights_by_name("model.no_such.weight")
    with pytest.raises(ValidationError):
        gr.pause_generation("sideways")
    with GRClient(srv.url) as anonymous, pytest.raises(Unauthorized):
        anonymous.status()
    with GRClient(srv.url, api_key="wrong") as wrong, pytest.raises(Forbidden):
        wrong.status()
    with GRClient(srv.url, api_key=KEY, bearer=True) as bearer:
        assert bearer.status().weights.weight_version
    gr.pause_generation()
    try:
        with pytest.raises(Paused) as info:
            gr.generate([1], max_new_tokens=1)
        assert info.value.retryable and info.value.status == 503
    finally:
        gr.continue_generation()
    with GRClient(f"http://127.0.0.1:{free_port()}") as nobody, pytest.raises(ConnectionFailed):
        nobody.health()


def test_every_call_has_a_timeout(srv):
    with GRClient(srv.url, api_key=KEY, generate_timeout=0.001) as hasty:
        with pytest.raises(ClientTimeout, match="no reply within"):
            hasty.generate([1, 2, 3], max_new_tokens=300)


def wait_running(gr: GRClient, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while gr.status().sections["scheduler"]["num_running"] == 0:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.005)


def test_flush_retries_until_the_engine_is_idle(gr):
    rid = gr.submit([1, 2, 3], max_new_tokens=400).request_id
    wait_running(gr)
    gr.pause_generation("in_place")  # the request keeps its KV: a flush must wait for it
    try:
        with pytest.raises(CacheBusy):
            gr.flush_cache()
        with pytest.raises(CacheBusy, match="did not succeed after 3 tries"):
            gr.flush_cache_until_ok(retries=3, interval=0.01)
    finally:
        threading.Timer(0.2, gr.continue_generation).start()  # it finishes after this
    # the request's 400 tokens run first: over 30 s on a loaded 2-core machine, so up to 100 s
    assert gr.flush_cache_until_ok(retries=2000, interval=0.05).success
    assert gr.result(rid).meta_info.finish_reason.type == "length"


def test_async_client(srv):
    async def main() -> None:
        async with AsyncGRClient(srv.url, api_key=KEY) as gr:
            out, info = await asyncio.gather(
                gr.generate([1, 2, 3], max_new_tokens=3), gr.server_info()
            )
            assert len(out.output_ids) == 3 and info.device == "cpu"
            await gr.pause_generation()
            assert (await gr.flush_cache_until_ok(retries=5, interval=0.01)).success
            assert (await gr.continue_generation()).paused is False
            assert (await gr.ready()).ready
            with pytest.raises(NotFound):
                await gr.get_weights_by_name("nope")

    asyncio.run(main())


def test_retries_ride_out_a_pause_with_backoff(srv):
    """retries=N: a /generate refused with 503 paused is tried again until the server resumes;
    without retries the same call fails at once; a non-retryable error is never retried."""
    with (
        GRClient(srv.url, api_key=KEY) as plain,
        GRClient(srv.url, api_key=KEY, retries=50, retry_max_wait=0.2) as patient,
    ):
        plain.pause_generation()
        try:
            with pytest.raises(Paused):
                plain.generate([1, 2, 3], max_new_tokens=2)
            threading.Timer(0.5, plain.continue_generation).start()
            t0 = time.monotonic()
            out = patient.generate([1, 2, 3], max_new_tokens=2)
            assert len(out.output_ids) == 2 and time.monotonic() - t0 >= 0.4
        finally:
            plain.continue_generation()
        calls = []
        real = patient._send
        patient._send = lambda call: calls.append(call.path) or real(call)
        with pytest.raises(NotFound):
            patient.get_weights_by_name("nope")
        assert calls == ["/get_weights_by_name"]  # a 404 is final: one try


def test_async_retries_ride_out_a_pause(srv):
    async def main() -> None:
        async with AsyncGRClient(srv.url, api_key=KEY, retries=50, retry_max_wait=0.2) as gr:
            await gr.pause_generation()
            asyncio.get_running_loop().call_later(
                0.5, lambda: asyncio.ensure_future(gr.continue_generation())
            )
            out = await gr.generate([1, 2, 3], max_new_tokens=2)
            assert len(out.output_ids) == 2

    asyncio.run(main())


def test_pull_weights_is_a_client_method(gr, tmp_path):
    """GRClient.pull_weights sends /pull_weights' body: a missing version dir is the server's
    404, raised as NotFound (the delta tests apply real deltas through the same method)."""
    with pytest.raises((NotFound, Forbidden, ValidationError)):
        gr.pull_weights(str(tmp_path), 7)
