"""Between the OpenAI-compatible routes and the engine: bodies -> GenerateRequests (chat's
prompt through chat_template.py), GenerateResults -> choices, replies and SSE chunks.

One request per prompt; its beams are its choices, best first (n == 1: one choice). A choice's
text is its tokens decoded without the stop token that ended it (SGLang's default); its
meta_info keeps every token. The chosen tokens' logprobs come with the first choice of each
request, as /generate's output_token_logprobs do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from grctl.engine.request import GenerateRequest, GenerateResult, SamplingParams, new_request_id
from grctl.engine.search.beam import BeamResult
from grctl.engine.search.logits_processors import parse_logits_processors
from grctl.errors import ValidationError
from grctl.protocol.openai import (
    ChoiceMeta,
    CompletionBody,
    Metadata,
    OpenAIBody,
    Usage,
)
from grctl.server.translation.generate import finish_reason, spans_of

FINISH_REASONS = {"stop": "stop", "item_complete": "stop", "length": "length", "abort": "abort"}


def refuse_unserved(body: OpenAIBody) -> None:
    """Fields whose non-default value grctl cannot honour: a 400 rather than another answer."""
    if body.stop:
        raise ValidationError("stop strings are not supported", hint="send stop_token_ids instead")
    for name, default in (
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ):
        if getattr(body, name) != default:
            raise ValidationError(f"{name} is not supported; leave it at {default}")
    if body.logit_bias:
        raise ValidationError(
            "logit_bias is not supported",
            hint='send logits_processors: [{"type": "token_bias", "token_bias": {...}}], '
            "added to log-probabilities, or token_suppress",
        )


def search_knobs(body: OpenAIBody) -> dict[str, Any]:
    """The OpenAI fields that are a search's own, under the engine's (and /generate's) names:
    one stage's, or a multi-stage request's item stage (openai_stages.py)."""
    return {
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
        "use_catalog": body.use_catalog,
    }


def sampling_of(body: OpenAIBody, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logits_processors=parse_logits_processors(body.logits_processors),
        **search_knobs(body),
    )


def needs_tokenizer(tokenizer: Any | None, what: str) -> Any:
    if tokenizer is None:
        raise ValidationError(
            f"{what} needs a tokenizer in the model directory",
            hint="send token ids instead, as prompt: [ids] on /v1/completions; or serve a "
            "--model-path that holds tokenizer files",
        )
    return tokenizer


def num_prompts(body: CompletionBody) -> int:
    """How many prompts a completions body holds, read without tokenizing any (for the queue
    bound, checked before the tokenizer runs)."""
    prompt = body.prompt
    if body.suffix:
        raise ValidationError("suffix is not supported")
    if prompt is None or prompt == "" or prompt == []:
        raise ValidationError("prompt is required (text or token ids) and may not be empty")
    if isinstance(prompt, str) or not isinstance(prompt[0], (str, list)):
        return 1
    return len(prompt)


def completion_prompts(body: CompletionBody, tokenizer: Any | None) -> list[list[int]]:
    """The prompt as token rows: text, [text, ...], [id, ...] or [[id, ...], ...]. CPU work on
    the request's text: the route runs it through offload(), after the queue bound."""
    num_prompts(body)
    prompt = body.prompt
    if isinstance(prompt, str):
        return [list(needs_tokenizer(tokenizer, "a text prompt").encode(prompt))]
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        tok = needs_tokenizer(tokenizer, "a text prompt")
        return [list(tok.encode(p)) for p in prompt]
    if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise ValidationError(
        "prompt must be a string, a list of strings, a list of token ids, or a list of such lists"
    )


MAX_TOP_LOGPROBS = 20  # OpenAI's bound of top_logprobs, and vLLM's default --max-logprobs


def top_logprobs_of(k: int | None, logprobs: bool, what: str) -> int:
    """How many alternatives per token a request asks for, within MAX_TOP_LOGPROBS."""
    if not k:
        return 0
    if not logprobs:
        raise ValidationError(f"{what} needs logprobs: true")
    if k > MAX_TOP_LOGPROBS:
        raise ValidationError(f"{what} must be at most {MAX_TOP_LOGPROBS}, got {k}")
    return k


def requests_of(
    body: OpenAIBody,
    rows: list[list[int]],
    max_new_tokens: int,
    logprobs: bool,
    top: int = 0,
    echo: bool = False,
) -> list[GenerateRequest]:
    """One request per prompt; a rid names one prompt, or is rid_0, rid_1, ... for a batch.
    `echo` with logprobs scores the prompt too (logprob_start_len 0)."""
    sampling = sampling_of(body, max_new_tokens)
    rids = (
        [body.rid] if len(rows) == 1 else [body.rid and f"{body.rid}_{i}" for i in range(len(rows))]
    )
    return [
        GenerateRequest(
            input_ids=tuple(row),
            sampling=sampling,
            return_logprob=logprobs,
            top_logprobs_num=top if logprobs else 0,
            request_id=rid or new_request_id(),
            logprob_start_len=0 if echo and logprobs else -1,
        )
        for row, rid in zip(rows, rids, strict=True)
    ]


def decode(ids: list[int], tokenizer: Any | None, skip_special_tokens: bool) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def token_text(token_id: int, tokenizer: Any | None) -> str:
    return str(token_id) if tokenizer is None else tokenizer.decode([token_id])


@dataclass
class Choice:
    """One beam of one request, as every reply shape reads it."""

    index: int
    text: str
    finish_reason: str
    matched_stop: int | None
    meta: ChoiceMeta
    # (token text, logprob) per output token (with echo, the prompt's first: its first None)
    logprobs: list[tuple[str, float | None]] | None
    top: list[list[tuple[str, float]] | None] | None = None  # per token, best first


def choices_of(
    results: list[GenerateResult],
    tokenizer: Any | None,
    skip_special_tokens: bool,
    echo_rows: list[list[int]] | None = None,
) -> list[Choice]:
    """Every request's beams as choices; with echo_rows (the prompts, one per result) each
    choice's text starts with its prompt's, and its logprobs with the prompt's scores."""
    out: list[Choice] = []
    for n, result in enumerate(results):
        beams = result.beams or [BeamResult(result.output_ids, 0.0, result.finish_reason)]
        for rank, beam in enumerate(beams):
            kind = "abort" if result.finish_reason == "abort" else beam.finish_reason
            ids = beam.output_ids
            matched = ids[-1] if kind == "stop" and ids else None
            shown = ids[:-1] if matched is not None else ids
            # item_results name each item once, so a beam may have no row: match by rank
            item = next((r for r in result.item_results or () if r.rank == rank), None)
            meta = ChoiceMeta(
                output_ids=list(ids),
                sequence_score=beam.sequence_score,
                finish_reason=finish_reason(
                    kind, ids, matched, None if item is None else item.item_id
                ),
                weight_version=result.weight_version,
                weight_versions=spans_of(result, len(ids)),
                request_id=result.request_id,
                item_ids=None if item is None else item.item_ids,
                item_id=None if item is None else item.item_id,
                is_complete=None if item is None else item.is_complete,
                catalog_version=result.catalog_version,
            )
            lps = result.output_token_logprobs if rank == 0 else None
            logprobs = top = None
            if lps is not None:
                logprobs = [
                    (token_text(t, tokenizer), float(lp)) for t, lp in zip(ids, lps, strict=False)
                ]
                if beam.output_top_logprobs is not None:
                    top = [
                        [(token_text(t, tokenizer), float(lp)) for lp, t in pairs]
                        for pairs in beam.output_top_logprobs
                    ]
            text = decode(shown, tokenizer, skip_special_tokens)
            if echo_rows is not None:
                text = decode(echo_rows[n], tokenizer, skip_special_tokens) + text
                scores = result.prompt_logprobs
                if logprobs is not None and scores is not None:
                    pairs = zip(scores.token_ids, scores.logprobs, strict=True)
                    logprobs = [(token_text(t, tokenizer), lp) for t, lp in pairs] + logprobs
                    if scores.top is not None:
                        alts = [
                            None
                            if row is None
                            else [(token_text(t, tokenizer), float(lp)) for lp, t in row]
                            for row in scores.top
                        ]
                        top = alts + (top or [])
            reason = FINISH_REASONS.get(kind, kind)
            out.append(Choice(len(out), text, reason, matched, meta, logprobs, top))
    return out


def usage_of(results: list[GenerateResult]) -> Usage:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def metadata_of(results: list[GenerateResult]) -> Metadata:
    first = results[0]
    spans = spans_of(first, len(first.output_ids))
    return Metadata(weight_version=first.weight_version, weight_versions=spans)


def created_now() -> int:
    return int(time.time())
