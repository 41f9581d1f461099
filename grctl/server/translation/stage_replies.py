"""A multi-stage request's reply (docs/http-api.md "Multi-stage requests"): every returned beam's
full response (reasoning + forced prefix + item), its stage spans and behaviour logprobs (null
where forced), and one StageGroupOut per reasoning sample."""

from __future__ import annotations

from typing import Any

import msgspec

from grctl.engine.stages import Group, StagedResult
from grctl.protocol.catalog import ItemResultOut
from grctl.protocol.generate import (
    BeamOut,
    FinishReason,
    GenerateResponse,
    StrictBeamMetaInfo,
    StrictMetaInfo,
    WeightVersionSpan,
)
from grctl.protocol.stages import StageGroupOut, StageSpan
from grctl.server.translation.generate import finish_reason, ids_text, is_gumbel


def _spans(versions: list[str]) -> list[WeightVersionSpan]:
    out: list[WeightVersionSpan] = []
    for t, v in enumerate(versions):
        if out and out[-1].version == v:
            out[-1].end = t + 1
        else:
            out.append(WeightVersionSpan(version=v, start=t, end=t + 1))
    return out


def _stage_spans(r: int, p: int, n: int) -> list[StageSpan]:
    parts = (("sampled", 0, r), ("forced", r, r + p), ("searched", r + p, r + p + n))
    return [StageSpan(kind=k, start=a, end=b) for k, a, b in parts if b > a]


def _group_beams(g: Group, start_rank: int, tokenizer: Any, with_lps: bool):
    """The group's returned beams as BeamOut, and their item rows (ranks from start_rank)."""
    r1, r2, req = g.reasoning, g.items, g.request
    if r2 is None:
        return [], []
    reasoning, prefix = list(r1.output_ids), list(req.prefix_ids)
    prefill_version = r2.token_versions[0] if r2.token_versions else r2.weight_version
    beams = r2.beams[:1] if req.best_only else r2.beams
    rows = {row.rank: row for row in r2.item_results or ()}
    outs, items = [], []
    spell = r1.text.return_text_in_logprobs and tokenizer is not None
    for rank, b in enumerate(beams):
        ids = reasoning + prefix + list(b.output_ids)
        lps = [*r1.output_token_logprobs, *([None] * len(prefix)), *b.output_token_logprobs]
        versions = [*r1.token_versions, *([prefill_version] * len(prefix))]
        versions += r2.token_versions[: len(b.output_ids)]
        row = rows.get(rank)
        item_id = None if row is None else row.item_id
        entries = None
        if with_lps:
            entries = [
                (lp, t, tokenizer.decode([t]) if spell else None)
                for lp, t in zip(lps, ids, strict=True)
            ]
        outs.append(
            BeamOut(
                output_ids=ids,
                text=ids_text(ids, tokenizer, r1.text),
                meta_info=StrictBeamMetaInfo(
                    sequence_score=b.sequence_score,
                    finish_reason=finish_reason(
                        b.finish_reason,
                        b.output_ids,
                        b.matched_stop,
                        item_id,
                        r2.text.item_finish_reason,
                    ),
                    output_token_logprobs=entries,
                    weight_versions=_spans(versions),
                    sampling_logprob=b.sampling_logprob,
                    gumbel_key=b.gumbel_key,
                    draw_order=b.draw_order,
                    group_id=g.group_id,
                    group_index=g.index,
                    beam_index=rank,
                    stage_spans=_stage_spans(len(reasoning), len(prefix), len(b.output_ids)),
                    behaviour_logprobs=lps,
                ),
            )
        )
        if row is not None:
            items.append(
                ItemResultOut(
                    rank=start_rank + rank,
                    token_ids=row.token_ids,
                    item_ids=row.item_ids,
                    item_id=row.item_id,
                    is_complete=row.is_complete,
                    score=row.score,
                )
            )
    return outs, items


def _group_out(g: Group, num_beams: int) -> StageGroupOut:
    r1, r2 = g.reasoning, g.items
    # an aborted item stage's beams are no sample of anything: no threshold (as one stage)
    stochastic = r2 is not None and is_gumbel(r2)
    kind = "abort" if r1 is None else r1.finish_reason
    return StageGroupOut(
        group_id=g.group_id,
        index=g.index,
        reasoning_ids=[] if r1 is None else list(r1.output_ids),
        reasoning_logprob=0.0 if r1 is None else float(sum(r1.output_token_logprobs or ())),
        reasoning_finish_reason="abort" if g.aborted and r2 is None else kind,
        reasoning_matched=None if r1 is None else r1.matched_stop,
        prefix_ids=list(g.request.prefix_ids),
        num_beams=num_beams,
        weight_version=(r2 or r1).weight_version if (r2 or r1) is not None else "",
        restarts=g.restarts,
        cached_tokens=0 if r2 is None else r2.cached_tokens,
        gumbel_threshold=r2.gumbel_threshold if stochastic else msgspec.UNSET,
    )


def staged_response(result: StagedResult, tokenizer: Any | None = None) -> GenerateResponse:
    req = result.request
    with_lps = req.stage_template.return_logprob
    beams, items, groups = [], [], []
    for g in result.groups:
        outs, rows = _group_beams(g, len(beams), tokenizer, with_lps)
        beams += outs
        items += rows
        groups.append(_group_out(g, len(outs)))
    done = [g for g in result.groups if g.reasoning is not None]
    top = beams[0] if beams else None
    first = next((g.items for g in result.groups if g.items is not None), None)
    tm = top.meta_info if top is not None else None
    stochastic = tm is not None and tm.gumbel_key is not None
    spans = tm.weight_versions if tm is not None else []
    version = spans[-1].version if spans else (done[0].reasoning.weight_version if done else "")
    completion = sum(len(g.reasoning.output_ids) for g in done)
    completion += sum(
        s.end - s.start for b in beams for s in b.meta_info.stage_spans[-1:] if s.kind == "searched"
    )
    meta = StrictMetaInfo(
        id=req.request_id,
        prompt_tokens=len(req.input_ids),
        completion_tokens=completion,
        cached_tokens=sum(g.reasoning.cached_tokens for g in done)
        + sum(g.items.cached_tokens for g in result.groups if g.items is not None),
        finish_reason=tm.finish_reason if tm is not None else FinishReason(type="abort"),
        weight_version=version,
        weight_versions=spans or [WeightVersionSpan(version=version)],
        num_retractions=sum(g.reasoning.num_retractions for g in done)
        + sum(g.items.num_retractions for g in result.groups if g.items is not None),
        beam_width=req.items.width,
        beam_results=beams,
        e2e_latency=result.latency_s,
        output_token_logprobs=tm.output_token_logprobs if tm is not None else None,
        output_token_logprobs_length=None
        if tm is None or tm.output_token_logprobs is None
        else len(tm.output_token_logprobs),
        item_results=items if first is not None and first.item_results is not None else None,
        catalog_version=first.catalog_version if first is not None else None,
        gumbel_threshold=groups[0].gumbel_threshold if stochastic else msgspec.UNSET,
        stage_groups=groups,
        stage_restarts=sum(g.restarts for g in result.groups),
    )
    text = top.text if top is not None else ""
    return GenerateResponse(
        text=text or "", output_ids=top.output_ids if top else [], meta_info=meta
    )
