"""Multi-stage requests on the OpenAI routes (docs/http-api.md "Multi-stage requests"): the
body's grctl fields (reasoning, forced_prefix, beam_return_mode) make it /generate's
multi-stage body over the same prompts (chat's: its rendered prompt), run as /generate runs it;
each reply's returned beams become choices, best first within each reasoning sample, samples in
order, prompts in order."""

from __future__ import annotations

from typing import Any

from grctl.errors import ValidationError
from grctl.protocol.generate import GenerateBody, GenerateResponse, SamplingParamsBody
from grctl.protocol.openai import ChoiceMeta, CompletionBody, Metadata, OpenAIBody, Usage
from grctl.server.translation.openai import (
    FINISH_REASONS,
    Choice,
    decode,
    search_knobs,
    token_text,
)


def is_staged(body: OpenAIBody) -> bool:
    if body.reasoning is None:
        if body.forced_prefix is not None or body.beam_return_mode is not None:
            raise ValidationError(
                "forced_prefix and beam_return_mode belong to a multi-stage request: send "
                "reasoning with them"
            )
        return False
    if isinstance(body, CompletionBody) and body.echo:
        raise ValidationError("echo is not served for multi-stage requests")
    return True


def staged_body(
    body: OpenAIBody, rows: list[list[int]], max_new_tokens: int, logprobs: bool
) -> GenerateBody:
    """/generate's body for the same work: the item stage from the OpenAI fields."""
    sp = SamplingParamsBody(
        max_new_tokens=max_new_tokens,
        stop_token_ids=body.stop_token_ids,
        logits_processors=body.logits_processors,
        **search_knobs(body),
        skip_special_tokens=body.skip_special_tokens,
        reasoning=body.reasoning,
        forced_prefix=body.forced_prefix,
        beam_return_mode=body.beam_return_mode,
    )
    batch = len(rows) > 1
    rid: str | list[str] | None = body.rid
    if batch and body.rid:
        rid = [f"{body.rid}_{i}" for i in range(len(rows))]
    elif batch:
        rid = None
    return GenerateBody(
        input_ids=list(rows) if batch else rows[0],
        sampling_params=sp,
        return_logprob=logprobs,
        rid=rid,
    )


def staged_choices(
    replies: list[GenerateResponse], tokenizer: Any | None, skip_special_tokens: bool
) -> list[Choice]:
    """Every reply's beams as choices, each with its own behaviour logprobs (null where the
    prefix was forced); the text leaves out a stop token that ended it, as one stage's do."""
    out: list[Choice] = []
    for reply in replies:
        meta = reply.meta_info
        for rank, b in enumerate(meta.beam_results or ()):
            bm, ids = b.meta_info, list(b.output_ids)
            fr = bm.finish_reason
            item = next((r for r in meta.item_results or () if r.rank == rank), None)
            matched = fr.matched if fr.type == "stop" and isinstance(fr.matched, int) else None
            if item is not None and item.is_complete:
                matched = None  # an item's last token is the item's, not a stop token
            shown = ids[:-1] if matched is not None and ids else ids
            spans = bm.weight_versions or []
            choice_meta = ChoiceMeta(
                output_ids=ids,
                sequence_score=bm.sequence_score,
                finish_reason=fr,
                weight_version=spans[-1].version if spans else meta.weight_version,
                weight_versions=spans,
                request_id=meta.id,
                item_ids=None if item is None else item.item_ids,
                item_id=None if item is None else item.item_id,
                is_complete=None if item is None else item.is_complete,
                catalog_version=meta.catalog_version,
                group_id=bm.group_id,
                group_index=bm.group_index,
                beam_index=bm.beam_index,
                stage_spans=bm.stage_spans,
            )
            logprobs = None
            if bm.output_token_logprobs is not None:
                logprobs = [
                    (token_text(t, tokenizer), None if lp is None else float(lp))
                    for t, lp in zip(ids, bm.behaviour_logprobs or (), strict=True)
                ]
            reason = FINISH_REASONS.get(fr.type, fr.type)
            text = decode(shown, tokenizer, skip_special_tokens)
            out.append(Choice(len(out), text, reason, matched, choice_meta, logprobs))
    return out


def staged_usage(replies: list[GenerateResponse]) -> Usage:
    prompt = sum(r.meta_info.prompt_tokens for r in replies)
    completion = sum(r.meta_info.completion_tokens for r in replies)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def staged_metadata(replies: list[GenerateResponse]) -> Metadata:
    meta = replies[0].meta_info
    return Metadata(weight_version=meta.weight_version, weight_versions=meta.weight_versions)
