"""Generation routes: /generate, /submit, /submit_many, /poll, /result, /cancel, /abort_request.

Engine calls that wait (generate, result) run in a worker thread (offload.py), and so does
every piece of CPU work on a body or a reply (tokenizing text, parsing exclusions at submit,
building replies); the rest only takes the engine's lock briefly (it is never held during a
model step), so it runs on the event loop. /generate takes one prompt or, as SGLang does, a
batch: input_ids [[...], ...] (or text [...]) answers a list of replies in order, computed in
the same engine batch.
"""

from __future__ import annotations

from typing import Annotated

from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.params import Body, Parameter
from litestar.status_codes import HTTP_202_ACCEPTED

from grctl.engine import stages
from grctl.engine.request import GenerateRequest, GenerateResult
from grctl.engine.stages import StagedRequest
from grctl.errors import DuplicateRequestId, PayloadTooLarge
from grctl.errors import ValidationError as BadRequest
from grctl.protocol.generate import (
    AbortRequestBody,
    AbortRequestResponse,
    CancelBody,
    CancelResponse,
    GenerateBody,
    GenerateResponse,
    PollResponse,
    SubmitManyBody,
    SubmitManyResponse,
    SubmitResponse,
)
from grctl.server.disconnect import unless_disconnected
from grctl.server.offload import offload, offload_json
from grctl.server.openapi import error_responses
from grctl.server.params import seconds
from grctl.server.staged import check_all, run_staged, submit_staged
from grctl.server.translation.generate import is_parallel, to_requests, to_response
from grctl.server.translation.length_default import LengthDefault


async def run_to_end(state: State, reqs: list[GenerateRequest]) -> list[GenerateResult]:
    """Submit all, wait for all, up to --generate-timeout-s; the engine cancels what overruns,
    and a cancelled handler cancels its requests."""
    engine = state.engine
    results = await offload(
        state,
        engine.generate_many,
        reqs,
        timeout=state.config.generate_timeout_s,
        on_cancel=lambda: engine.discard([r.request_id for r in reqs]),
    )
    for result in results:
        state.metrics.observe_result(result)
    return results


async def staged_to_end(
    state: State, request: Request, reqs: list[StagedRequest]
) -> list[GenerateResponse]:
    """Multi-stage requests to their replies (staged.py); a client that goes away cancels
    them."""
    control = stages.Control()
    return await unless_disconnected(
        request,
        lambda: offload(
            state, run_staged, state, reqs, control, on_cancel=lambda: control.cancel(state.engine)
        ),
    )


@post(
    "/generate",
    status_code=200,
    summary="Generate (SGLang-compatible); n > 1 is beam search; a batch of prompts gives a list",
    responses=error_responses(400, 409, 413, 429, 503, 504),
)
async def generate(
    state: State, request: Request, data: Annotated[GenerateBody | None, Body()] = None
) -> Response[GenerateResponse | list[GenerateResponse]]:
    reqs, is_batch = await offload(
        state,
        to_requests,
        data or GenerateBody(),
        state.tokenizer,
        state.config.parallel_sampling,
        LengthDefault.of_engine(state.engine),
    )
    if reqs and isinstance(reqs[0], StagedRequest):  # to_requests: all of a batch, or none
        replies = await staged_to_end(state, request, reqs)
        return await offload_json(state, chosen, replies, is_batch)
    state.staged.refuse_taken([r.request_id for r in reqs])
    # A client that goes away cancels its requests (run_to_end's on_cancel).
    results = await unless_disconnected(request, lambda: run_to_end(state, reqs))
    return await offload_json(state, responses, results, state.tokenizer, is_batch)


def responses(
    results: list[GenerateResult], tokenizer, is_batch: bool
) -> list[GenerateResponse] | GenerateResponse:
    return chosen([to_response(r, tokenizer) for r in results], is_batch)


def chosen(replies: list[GenerateResponse], is_batch: bool):
    """A batch's replies, or one prompt's reply."""
    return replies if is_batch else replies[0]


@post(
    "/submit",
    status_code=HTTP_202_ACCEPTED,
    summary="Queue one request; poll for it",
    responses=error_responses(400, 409, 413, 429, 503),
)
async def submit(
    state: State, data: Annotated[GenerateBody | None, Body()] = None
) -> SubmitResponse:
    reqs, is_batch = await offload(
        state,
        to_requests,
        data or GenerateBody(),
        state.tokenizer,
        False,
        LengthDefault.of_engine(state.engine),
    )
    if is_batch:
        raise BadRequest("/submit takes one prompt", hint="use /submit_many for a batch")
    if isinstance(reqs[0], StagedRequest):
        (rid,) = await offload(state, submit_staged, state, reqs)
        return SubmitResponse(request_id=rid)
    one_sequence(state, reqs[0])
    state.staged.refuse_taken([reqs[0].request_id])
    # submit parses the request's exclusions against the catalog: off the event loop too
    return SubmitResponse(request_id=await offload(state, state.engine.submit, reqs[0]))


@post(
    "/submit_many",
    status_code=HTTP_202_ACCEPTED,
    summary="Queue a batch, all or none",
    responses=error_responses(400, 409, 413, 429, 503),
)
async def submit_many(
    state: State, data: Annotated[SubmitManyBody | None, Body()] = None
) -> SubmitManyResponse:
    bodies = data.requests if data else []
    limit = state.config.max_http_submit_many
    if len(bodies) > limit:
        raise PayloadTooLarge(
            f"submit_many takes at most {limit} requests, got {len(bodies)}",
            hint="split the batch, or raise --max-http-submit-many",
        )
    return SubmitManyResponse(request_ids=await offload(state, queue_all, state, bodies))


def queue_all(state: State, bodies: list[GenerateBody]) -> list[str]:
    """Every row checked, then all queued or none (in a worker thread: it tokenizes and parses
    each row's exclusions). The multi-stage rows run as one batch of their own (staged.py),
    started once the others are queued."""
    engine = state.engine
    lengths = LengthDefault.of_engine(engine)
    reqs = [one_request(b, state.tokenizer, lengths) for b in bodies]
    staged = [r for r in reqs if isinstance(r, StagedRequest)]
    plain = [r for r in reqs if not isinstance(r, StagedRequest)]
    for req in plain:  # every row passes the engine's own checks before any is queued
        one_sequence(state, req)
        engine.validate(req)
    if staged:
        check_all(state, staged)
    engine.check_batch_fits(len(plain) + sum(r.num_samples for r in staged))
    ids = [r.request_id for r in reqs]
    if len(set(ids)) != len(ids):
        raise DuplicateRequestId("the batch repeats a request id; nothing was queued")
    state.staged.refuse_taken(ids)
    queued: list[str] = []
    try:
        for req in plain:
            queued.append(engine.submit(req))
        if staged:
            queued += submit_staged(state, staged)
    except Exception:  # paused, overloaded or a taken id part-way: take the batch back
        engine.discard(queued)
        raise
    return ids


def one_request(body: GenerateBody, tokenizer, lengths: LengthDefault) -> GenerateRequest:
    reqs, is_batch = to_requests(body, tokenizer, lengths=lengths)
    if is_batch:
        raise BadRequest("each /submit_many request takes one prompt, not a batch")
    return reqs[0]


def one_sequence(state: State, req: GenerateRequest) -> None:
    """Under --parallel-sampling, n samples are n replies: only /generate answers them."""
    if state.config.parallel_sampling and is_parallel(req):
        raise BadRequest(
            f"n {req.sampling.n} without beam_width is {req.sampling.n} samples under "
            "--parallel-sampling: /generate returns them, one reply each",
            hint="submit n requests of n 1, or send beam_width for a beam search",
        )


@get(
    "/poll/{request_id:str}",
    summary="Whether a request has finished, and its reply if so",
    responses=error_responses(404),
)
async def poll(state: State, request_id: str) -> Response[PollResponse]:
    run = state.staged.get(request_id)
    if run is not None:  # a queued multi-stage request
        reply = state.staged.poll(run)
        return Response(PollResponse(ready=reply is not None, response=reply))
    result = state.engine.poll(request_id)
    if result is None:
        return Response(PollResponse(ready=False))
    return await offload_json(state, ready_reply, result, state.tokenizer)


def ready_reply(result: GenerateResult, tokenizer) -> PollResponse:
    return PollResponse(ready=True, response=to_response(result, tokenizer))


@get(
    "/result/{request_id:str}",
    summary="Wait for a request's reply (504 after `timeout`, at most --generate-timeout-s)",
    responses=error_responses(404, 504),
)
async def result(
    state: State,
    request_id: str,
    timeout: float | None = Parameter(default=None, description="seconds to wait"),
) -> Response[GenerateResponse]:
    limit = state.config.generate_timeout_s
    wait = seconds(timeout, limit=limit, default=limit)
    run = state.staged.get(request_id)
    if run is not None:  # a queued multi-stage request
        return await offload_json(state, state.staged.result, run, wait)
    res = await offload(state, state.engine.result, request_id, timeout=wait)
    state.metrics.observe_result(res)
    return await offload_json(state, to_response, res, state.tokenizer)


@post(
    "/cancel",
    status_code=200,
    summary="Cancel one request by request_id",
    responses=error_responses(400, 404),
)
async def cancel(state: State, data: Annotated[CancelBody | None, Body()] = None) -> CancelResponse:
    request_id = data and (data.request_id or data.rid)
    if not request_id:
        raise BadRequest("request_id is required")
    groups = state.staged.abort(state.engine, request_id)
    if groups is not None:  # a multi-stage request: aborted, its groups cleared
        await offload(state, clear_groups, state, groups)
        return CancelResponse(request_id=request_id, cancelled=True)
    if state.staged.get(request_id) is not None:  # a multi-stage one that has finished
        return CancelResponse(request_id=request_id, cancelled=False)
    cancelled = state.engine.cancel(request_id)
    if not cancelled:
        state.engine.poll(request_id)  # NotFound (404) unless it finished and awaits fetching
    return CancelResponse(request_id=request_id, cancelled=cancelled)


@post("/abort_request", status_code=200, summary="Abort one request (rid) or all (abort_all)")
async def abort_request(
    state: State, data: Annotated[AbortRequestBody | None, Body()] = None
) -> AbortRequestResponse:
    body = data or AbortRequestBody()
    if body.abort_all:
        num = state.staged.abort_all(state.engine) + state.engine.abort_all()
        await offload(state, state.beam_groups.clear)
    elif body.rid:  # SGLang semantics: an unknown or finished rid is not an error
        groups = state.staged.abort(state.engine, body.rid)
        if groups is not None:  # a multi-stage request: both stages, and its beam groups
            await offload(state, clear_groups, state, groups)
            num = 1
        else:
            num = int(state.engine.cancel(body.rid))
    else:
        num = 0
    return AbortRequestResponse(success=True, num_aborted_requests=num)


def clear_groups(state: State, group_ids: tuple[str, ...]) -> None:
    for gid in group_ids:
        state.beam_groups.discard(gid)


generate_routes = [generate, submit, submit_many, poll, result, cancel, abort_request]
