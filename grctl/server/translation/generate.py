"""Between the wire and the engine: request bodies -> GenerateRequest, GenerateResult -> replies."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import msgspec

from grctl.engine.request import GenerateRequest, GenerateResult, TextOptions, new_request_id
from grctl.engine.search.beam import BeamResult
from grctl.engine.stages import StagedRequest
from grctl.errors import DuplicateRequestId, ValidationError
from grctl.protocol.catalog import ItemResultOut
from grctl.protocol.generate import (
    BeamOut,
    FinishReason,
    GenerateBody,
    GenerateResponse,
    LogprobEntry,
    SamplingParamsBody,
    StrictBeamMetaInfo,
    StrictMetaInfo,
    WeightVersionSpan,
)
from grctl.server.translation.length_default import FREE, LengthDefault
from grctl.server.translation.sampling import (
    check_body,
    sampling_of,
    text_options_of,
    wants_top_p_token_ids,
    with_custom_params,
)
from grctl.server.translation.stages import is_multi_stage, staged_request


def prompt_rows(body: GenerateBody, tokenizer: Any | None) -> tuple[list[list[int]], bool]:
    """The prompts as token rows, and whether the body is a batch (then the reply is a list)."""
    if body.input_ids is not None and body.text is not None:
        raise ValidationError("send either input_ids or text, not both")
    if body.text is not None:
        if tokenizer is None:
            raise ValidationError(
                "text needs a tokenizer in the model directory",
                hint="send input_ids, or serve a --model-path that holds tokenizer files",
            )
        texts = body.text if isinstance(body.text, list) else [body.text]
        rows, is_batch = [list(tokenizer.encode(t)) for t in texts], isinstance(body.text, list)
    else:
        ids = body.input_ids
        if ids is None:
            raise ValidationError("input_ids is required")
        if all(isinstance(t, int) for t in ids):
            rows, is_batch = [ids], False
        elif all(isinstance(t, list) for t in ids):
            rows, is_batch = ids, True
        else:
            raise ValidationError("input_ids must be [S] or a batch [[S], ...], not a mix")
    if not rows or any(not row for row in rows):
        raise ValidationError("input_ids is empty" if not is_batch else "a prompt is empty")
    return rows, is_batch


def per_prompt(value: Any, n: int, what: str) -> list[Any]:
    """One value for every prompt, or a list of exactly one per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise ValidationError(f"{what} holds {len(value)} entries for {n} prompt(s)")
    return value


def to_requests(
    body: GenerateBody,
    tokenizer: Any | None = None,
    parallel_sampling: bool = False,
    lengths: LengthDefault = FREE,
) -> tuple[list[GenerateRequest], bool]:
    """Validate a /generate body: its requests (each with an id), and whether it is a batch.
    parallel_sampling (--parallel-sampling): n without beam_width is n samples (SGLang);
    `lengths`: max_new_tokens where a request leaves it out."""
    if body.stream:
        raise ValidationError("stream is not supported; send stream=false and read the reply")
    rows, is_batch = prompt_rows(body, tokenizer)
    if isinstance(body.rid, list) and not is_batch:
        raise ValidationError("rid is a list but there is one prompt; send a string")
    rids = per_prompt(body.rid or body.request_id, len(rows), "rid")
    if is_batch and body.rid is not None and not isinstance(body.rid, list):
        raise ValidationError("a batch takes rid as a list, one id per prompt")
    given = [r for r in rids if r]
    if len(set(given)) != len(given):
        raise DuplicateRequestId("the batch repeats a rid; nothing was queued")
    params = per_prompt(body.sampling_params, len(rows), "sampling_params")
    starts = per_prompt(body.logprob_start_len, len(rows), "logprob_start_len")
    check_body(body)
    detokenize = tokenizer.decode if tokenizer is not None else None
    reqs = []
    for row, sp, rid, start in zip(rows, params, rids, starts, strict=True):
        sp = sp or SamplingParamsBody()
        top_p_ids = wants_top_p_token_ids(sp)
        sp = with_custom_params(sp)
        req = GenerateRequest(
            input_ids=tuple(row),
            sampling=sampling_of(body, sp, lengths.of(sp.use_catalog, len(row))),
            return_logprob=body.return_logprob,
            request_id=rid or new_request_id(),
            top_logprobs_num=body.top_logprobs_num,
            # SGLang ignores it without return_logprob
            logprob_start_len=start if body.return_logprob else -1,
            return_original_logprob=body.return_original_logprob,
            return_sampling_mask=body.return_sampling_mask or top_p_ids,
            detokenize=detokenize,
            text=text_options_of(body, sp, top_p_ids),
        )
        if is_multi_stage(sp):
            reasoning_length = lengths.of(False, len(row))
            req = staged_request(body, sp, req.sampling, req, tokenizer, reasoning_length)
        reqs.append(req)
    staged = [isinstance(r, StagedRequest) for r in reqs]
    if any(staged) and not all(staged):
        raise ValidationError(
            "a batch mixes multi-stage and one-stage prompts",
            hint="send them as two requests",
        )
    if parallel_sampling and not any(staged) and any(is_parallel(r) for r in reqs):
        return parallel_samples(reqs, rids), True
    return reqs, is_batch


def is_parallel(req: GenerateRequest) -> bool:
    """SGLang's parallel sampling: n > 1 without beam_width."""
    return req.sampling.n > 1 and req.sampling.beam_width is None


def parallel_samples(reqs: list[GenerateRequest], rids: list[str | None]) -> list[GenerateRequest]:
    """SGLang's expansion of n samples: n requests of n 1 per prompt, sample-major (the batch
    repeated n times: prompt i's sample j is reply j * prompts + i), rid r becoming r_0, r_1, ...
    in that order (SGLang names a batch's samples from one rid the same way)."""
    ns = {r.sampling.n for r in reqs}
    if len(ns) > 1 or not all(map(is_parallel, reqs)):
        raise ValidationError(
            f"n differs between the prompts ({sorted(ns)}); with --parallel-sampling every "
            "prompt of a batch takes the same n (SGLang's rule)"
        )
    (n,) = ns
    out = []
    for j in range(n):
        for req, rid in zip(reqs, rids, strict=True):
            name = f"{rid}_{j}" if rid else new_request_id()
            one = dataclasses.replace(req.sampling, n=1)
            out.append(dataclasses.replace(req, sampling=one, request_id=name))
    return out


def finish_reason(
    kind: str,
    output_ids: list[int],
    matched: int | str | None,
    item_id: int | str | None = None,
    item_form: str = "stop",
) -> FinishReason:
    """SGLang's finish_reason. A beam that completed a catalog item ends like one a stop token
    ended (type "stop", which trainers written for SGLang count as a finished sample), with
    item_id naming the item; item_form "item_complete" (sampling_params.item_finish_reason)
    reports grctl's own type instead."""
    if kind == "item_complete":
        return FinishReason(type=item_form, item_id=item_id)
    if kind == "stop":
        return FinishReason(type="stop", matched=matched)
    if kind == "length":
        return FinishReason(type="length", length=len(output_ids))
    return FinishReason(type=kind)


def _finish_of(result: GenerateResult, rank: int, beam: BeamResult | None) -> FinishReason:
    """Beam `rank`'s finish_reason (None: the request's own), the item read from item_results."""
    row = next((r for r in result.item_results or () if r.rank == rank), None)
    kind, ids, matched = (
        (result.finish_reason, result.output_ids, result.matched_stop)
        if beam is None
        else (beam.finish_reason, beam.output_ids, beam.matched_stop)
    )
    item_id = None if row is None else row.item_id
    return finish_reason(kind, ids, matched, item_id, result.text.item_finish_reason)


def ids_text(
    output_ids: list[int], tokenizer: Any | None, opts: TextOptions = TextOptions()
) -> str:
    if tokenizer is None:
        return " ".join(map(str, output_ids))
    kw = {}
    if opts.skip_special_tokens is not None:
        kw["skip_special_tokens"] = opts.skip_special_tokens
    if opts.spaces_between_special_tokens is not None:
        kw["spaces_between_special_tokens"] = opts.spaces_between_special_tokens
    return tokenizer.decode(output_ids, **kw)


def beam_text(beam: BeamResult, tokenizer: Any | None, opts: TextOptions) -> str:
    """A beam's text as SGLang spells it: without the stop token or string that ended it,
    unless no_stop_trim."""
    ids = beam.output_ids
    if opts.no_stop_trim or beam.finish_reason != "stop":
        return ids_text(ids, tokenizer, opts)
    if isinstance(beam.matched_stop, str):
        text = ids_text(ids, tokenizer, opts)
        cut = text.find(beam.matched_stop)
        return text[:cut] if cut >= 0 else text
    return ids_text(ids[:-1], tokenizer, opts)


def _entries(
    lps: list[float], ids: list[int], tokenizer: Any | None, opts: TextOptions
) -> list[LogprobEntry]:
    spell = opts.return_text_in_logprobs and tokenizer is not None
    return [
        (float(lp), int(t), tokenizer.decode([t]) if spell else None)
        for lp, t in zip(lps, ids, strict=True)
    ]


def _top_entries(tops: list | None, tokenizer: Any | None, opts: TextOptions):
    """Per token, its top (logprob, id) pairs as entries; a None row stays None."""
    if tops is None:
        return None
    return [
        None
        if pairs is None
        else _entries([lp for lp, _ in pairs], [t for _, t in pairs], tokenizer, opts)
        for pairs in tops
    ]


def _input_entries(result: GenerateResult, tokenizer: Any | None):
    """input_token_logprobs and input_top_logprobs: [] without prompt scores (SGLang)."""
    scores = result.prompt_logprobs
    if scores is None:
        return [], None
    spell = result.text.return_text_in_logprobs and tokenizer is not None
    entries = [
        (lp, t, tokenizer.decode([t]) if spell else None)
        for lp, t in zip(scores.logprobs, scores.token_ids, strict=True)
    ]
    return entries, _top_entries(scores.top, tokenizer, result.text)


def _mask_fields(b: BeamResult | None, opts: TextOptions) -> dict:
    """The sampling-support fields of one beam: SGLang's sampling mask (per token the support
    and the chosen token's log-probability, "selected", or the support's, "support") and
    slime's top-p ids, each when asked; {} when neither was."""
    if b is None or (b.sampling_mask is None and not b.mask_overflow):
        return {}
    if b.mask_overflow:
        raise ValidationError(
            "a step's sampling support exceeds --sampling-mask-max-tokens",
            hint="lower top_k (or top_p) to narrow the support, or raise the server's "
            "--sampling-mask-max-tokens",
        )
    fields = _top_p_fields(b.sampling_mask) if opts.top_p_token_ids else {}
    if not opts.sampling_mask:
        return fields
    if opts.sampling_logprobs_mode == "support":
        values: list = b.sampling_mask_logprobs
    else:
        values = [
            lps[mask.index(t)]
            for t, mask, lps in zip(
                b.output_ids, b.sampling_mask, b.sampling_mask_logprobs, strict=True
            )
        ]
    return {
        **fields,
        "output_token_sampling_mask": b.sampling_mask,
        "output_token_sampling_logprobs": values,
        "output_token_sampling_mask_length": len(b.sampling_mask),
    }


def _top_p_fields(masks: list[list[int]]) -> dict:
    """slime's top-p replay (its patched SGLang's meta_info keys): every token's support,
    flattened, and offsets from 0, one more than the tokens (token t's: ids[off[t]:off[t + 1]]).
    Plain JSON lists; slime's reader also takes the patch's base64 int32."""
    return {
        "top_p_token_ids": [t for mask in masks for t in mask],
        "top_p_token_offsets": [0, *itertools.accumulate(map(len, masks))],
    }


def _beam_out(
    b: BeamResult,
    rank: int,
    result: GenerateResult,
    tokenizer: Any | None,
    completion_tokens: int | None,
) -> BeamOut:
    opts = result.text
    lps = None
    if b.output_token_logprobs is not None:
        lps = _entries(b.output_token_logprobs, b.output_ids, tokenizer, opts)
    return BeamOut(
        output_ids=b.output_ids,
        text=beam_text(b, tokenizer, opts),
        meta_info=StrictBeamMetaInfo(
            sequence_score=b.sequence_score,
            finish_reason=_finish_of(result, rank, b),
            completion_tokens=completion_tokens,
            output_token_logprobs=lps,
            output_top_logprobs=_top_entries(b.output_top_logprobs, tokenizer, opts),
            weight_versions=spans_of(result, len(b.output_ids)),
            sampling_logprob=b.sampling_logprob,
            gumbel_key=b.gumbel_key,
            draw_order=b.draw_order,
            **_mask_fields(b, opts),
        ),
    )


def spans_of(result: GenerateResult, num_tokens: int) -> list[WeightVersionSpan]:
    return [
        WeightVersionSpan(version=v, start=a, end=b) for v, a, b in result.version_spans(num_tokens)
    ]


def _items(result: GenerateResult) -> list[ItemResultOut] | None:
    if result.item_results is None:
        return None
    return [
        ItemResultOut(
            rank=r.rank,
            token_ids=r.token_ids,
            item_ids=r.item_ids,
            item_id=r.item_id,
            is_complete=r.is_complete,
            score=r.score,
        )
        for r in result.item_results
    ]


def is_gumbel(result: GenerateResult) -> bool:
    """Stochastic beams that ran to their end, whose reply carries gumbel_threshold (null: the
    support was drawn); an aborted one's is absent (its beams are no sample of anything)."""
    drawn = any(b.gumbel_key is not None for b in result.beams)
    return drawn and result.finish_reason != "abort"


def to_response(result: GenerateResult, tokenizer: Any | None = None) -> GenerateResponse:
    """SGLang's reply: the best beam at the top level, every returned beam under
    meta_info.beam_results; with beam_width (SGLang's form) beam 0 also carries the summed
    completion_tokens and the top level its sequence_score."""
    sglang_form = result.beam_width is not None
    summed = result.completion_tokens if sglang_form else None
    beams = [
        _beam_out(b, i, result, tokenizer, summed if i == 0 else None)
        for i, b in enumerate(result.beams)
    ]
    top = result.beams[0] if result.beams else None
    logprobs = top_lps = in_lps = in_top = None
    if result.output_token_logprobs is not None:
        logprobs = _entries(result.output_token_logprobs, result.output_ids, tokenizer, result.text)
        if top is not None:
            top_lps = _top_entries(top.output_top_logprobs, tokenizer, result.text)
        in_lps, in_top = _input_entries(result, tokenizer)
    meta = StrictMetaInfo(
        id=result.request_id,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens,
        finish_reason=_finish_of(result, 0, None),
        weight_version=result.weight_version,
        weight_versions=spans_of(result, len(result.output_ids)),
        num_retractions=result.num_retractions,
        beam_width=result.beam_width or max(1, len(result.beams)),
        beam_results=beams,
        e2e_latency=result.latency_s,
        sequence_score=top.sequence_score if sglang_form and top is not None else None,
        output_token_logprobs=logprobs,
        output_token_logprobs_length=None if logprobs is None else len(logprobs),
        output_top_logprobs=top_lps,
        input_token_logprobs=in_lps,
        input_top_logprobs=in_top if in_top is not None else None if top_lps is None else [],
        item_results=_items(result),
        catalog_version=result.catalog_version,
        kv_recomputed_at=result.kv_recomputed_at or None,
        item_prefix_len=result.item_prefix_len,
        unknown_exclude_item_ids=result.unknown_exclude_item_ids or None,
        gumbel_threshold=result.gumbel_threshold if is_gumbel(result) else msgspec.UNSET,
        **_mask_fields(top, result.text),
    )
    text = beam_text(top, tokenizer, result.text) if top is not None else ""
    return GenerateResponse(text=text, output_ids=result.output_ids, meta_info=meta)
