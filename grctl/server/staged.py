"""Running a body's multi-stage requests (engine/stages.py) and shaping their replies, for
/generate (in its handler's thread), /submit and /submit_many (queued: server/staged_runs.py)
and /v1/completions: requests without a beam_group_id run as one engine batch; each one with
a beam_group_id goes through the server's BeamGroups, computed once per group and answered
with its beam_index's beam (docs/http-api.md "Beam groups")."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
from litestar.datastructures import State

from grctl.engine import stages
from grctl.engine.stages import StagedRequest
from grctl.errors import ValidationError
from grctl.protocol.generate import GenerateResponse
from grctl.server.translation.stage_replies import staged_response


def fingerprint(req: StagedRequest) -> str:
    """What every call of one group must share: the prompt and both stages' parameters."""
    what = (req.input_ids, req.reasoning, req.num_samples, req.prefix_ids, req.items)
    return hashlib.sha256(repr((what, req.best_only)).encode()).hexdigest()


def one_beam(
    reply: GenerateResponse, rid: str, group_id: str, index: int, width: int
) -> GenerateResponse:
    """The group's reply cut to beam `index mod width` (the last returned one when fewer
    returned), which becomes the top level too."""
    meta = reply.meta_info
    beams = meta.beam_results
    if not beams:
        return msgspec.structs.replace(
            reply, meta_info=msgspec.structs.replace(meta, id=rid, beam_group_id=group_id)
        )
    i = min(index % width, len(beams) - 1)
    b = beams[i]
    bm = b.meta_info
    rows = [r for r in meta.item_results or () if r.rank == i]
    items = [msgspec.structs.replace(r, rank=0) for r in rows] if meta.item_results else None
    spans = bm.weight_versions or []
    top = msgspec.structs.replace(
        meta,
        id=rid,
        beam_results=[b],
        finish_reason=bm.finish_reason,
        weight_versions=spans,
        weight_version=spans[-1].version if spans else meta.weight_version,
        output_token_logprobs=bm.output_token_logprobs,
        output_token_logprobs_length=None
        if bm.output_token_logprobs is None
        else len(bm.output_token_logprobs),
        item_results=items,
        beam_group_id=group_id,
        beam_index=i,
    )
    return GenerateResponse(text=b.text or "", output_ids=b.output_ids, meta_info=top)


def check_stages(engine, req: StagedRequest) -> None:
    """Both stages pass the engine's checks before anything runs: stage 2 as if its reasoning
    ran to its longest (so a prefix past the vocabulary, a width over the limit or a context
    past --max-context-len is a 400 at once, not after stage 1)."""
    g = stages.Group(req, 0)
    with _in_stage("the reasoning stage (stage 1)"):  # first: it bounds the reasoning
        engine.validate(g.stage_request(1))
    longest = (*req.input_ids, *[0] * req.reasoning.max_new_tokens, *req.prefix_ids)
    with _in_stage("the item stage (stage 2, after the longest reasoning and the prefix)"):
        engine.validate(g.stage_request(2, longest))


@contextmanager
def _in_stage(stage: str) -> Iterator[None]:
    """A refusal of a stage's request says which stage: its knobs may not be named as sent."""
    try:
        yield
    except ValidationError as exc:
        raise ValidationError(f"{stage}: {exc.message}", hint=exc.hint) from None


def check_all(state: State, reqs: list[StagedRequest]) -> None:
    """Every request's both stages, and the batch's size, before any runs (a 400 at once)."""
    engine = state.engine
    for req in reqs:
        check_stages(engine, req)
    engine.check_batch_fits(sum(r.num_samples for r in reqs))


def run_staged(
    state: State, reqs: list[StagedRequest], control: stages.Control
) -> list[GenerateResponse]:
    """In a worker thread: every request to its reply, in order (/generate's requests, known to
    state.staged while they run so /abort_request reaches them)."""
    check_all(state, reqs)
    with state.staged.tracked(reqs, control, state.engine.is_known):
        return compute_staged(state, reqs, control)


def submit_staged(state: State, reqs: list[StagedRequest]) -> list[str]:
    """/submit's and /submit_many's: checked, then queued to run in a thread of their own
    (server/staged_runs.py), their replies kept for /poll and /result."""
    check_all(state, reqs)
    state.engine.check_open()  # paused, weights mixed...: refused now, as any submit is
    return state.staged.start(
        reqs, lambda control: compute_staged(state, reqs, control), state.engine.is_known
    )


def compute_staged(
    state: State, reqs: list[StagedRequest], control: stages.Control
) -> list[GenerateResponse]:
    engine, tokenizer = state.engine, state.tokenizer
    timeout = state.config.generate_timeout_s
    replies: dict[str, GenerateResponse] = {}
    plain = [r for r in reqs if not r.group_ids]
    for res in stages.run(engine, plain, timeout, control) if plain else ():
        replies[res.request.request_id] = staged_response(res, tokenizer)
    for req in reqs:
        if not req.group_ids:
            continue
        (gid,) = req.group_ids

        def compute(req: StagedRequest = req, gid: str = gid) -> GenerateResponse:
            with state.staged.computing(gid, control, req.request_id):
                return staged_response(stages.run(engine, [req], timeout, control)[0], tokenizer)

        whole = state.beam_groups.serve(
            gid, fingerprint(req), req.items.width, compute, timeout=timeout
        )
        replies[req.request_id] = one_beam(
            whole, req.request_id, gid, req.group_index, req.items.width
        )
    out = [replies[r.request_id] for r in reqs]
    for reply in out:
        meta = reply.meta_info
        state.metrics.observe(meta.finish_reason.type, meta.e2e_latency or 0.0)
    return out
