"""Between the wire and the engine: request bodies -> GenerateRequest, GenerateResult -> replies."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from grctl.engine.request import GenerateRequest, GenerateResult, SamplingParams, new_request_id
from grctl.engine.search.logits_processors import parse_logits_processors
from grctl.errors import DuplicateRequestId, ValidationError
from grctl.protocol.catalog import ItemResultOut
from grctl.protocol.generate import (
    BeamMetaInfo,
    BeamOut,
    FinishReason,
    GenerateBody,
    GenerateResponse,
    SamplingParamsBody,
    StrictMetaInfo,
)

log = logging.getLogger("grctl.server")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_path: str | None) -> Any | None:
    """The checkpoint's tokenizer, or None when its directory holds none (ids-only serving)."""
    if model_path is None or not any((Path(model_path) / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # a broken tokenizer must not stop ids-only serving
        log.warning("no tokenizer: cannot load one from %s: %s", model_path, exc)
        return None


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
    body: GenerateBody, tokenizer: Any | None = None
) -> tuple[list[GenerateRequest], bool]:
    """Validate a /generate body: its requests (each with an id), and whether it is a batch."""
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
    reqs = [
        GenerateRequest(
            input_ids=tuple(row),
            sampling=sampling_of(body, sp or SamplingParamsBody()),
            return_logprob=body.return_logprob,
            request_id=rid or new_request_id(),
        )
        for row, sp, rid in zip(rows, params, rids, strict=True)
    ]
    return reqs, is_batch


def sampling_of(body: GenerateBody, sp: SamplingParamsBody) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=sp.max_new_tokens,
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=sp.seed,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
        use_catalog=sp.use_catalog,
        logits_processors=parse_logits_processors(body.logits_processors)
        + parse_logits_processors(sp.logits_processors),
    )


def finish_reason(kind: str, output_ids: list[int], matched: int | None) -> FinishReason:
    if kind == "stop":
        return FinishReason(type="stop", matched=matched)
    if kind == "length":
        return FinishReason(type="length", length=len(output_ids))
    return FinishReason(type=kind)


def ids_text(output_ids: list[int], tokenizer: Any | None) -> str:
    if tokenizer is None:
        return " ".join(map(str, output_ids))
    return tokenizer.decode(output_ids)


def to_response(result: GenerateResult, tokenizer: Any | None = None) -> GenerateResponse:
    beams = [
        BeamOut(
            output_ids=b.output_ids,
            meta_info=BeamMetaInfo(
                sequence_score=b.sequence_score,
                finish_reason=finish_reason(
                    b.finish_reason,
                    b.output_ids,
                    b.output_ids[-1] if b.finish_reason == "stop" and b.output_ids else None,
                ),
            ),
        )
        for b in result.beams
    ]
    logprobs = None
    if result.output_token_logprobs is not None:
        logprobs = [
            (float(lp), int(t), None)
            for lp, t in zip(result.output_token_logprobs, result.output_ids, strict=False)
        ]
    meta = StrictMetaInfo(
        id=result.request_id,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens,
        finish_reason=finish_reason(result.finish_reason, result.output_ids, result.matched_stop),
        weight_version=result.weight_version,
        weight_versions=list(result.weight_versions),
        beam_width=max(1, len(result.beams)),
        beam_results=beams,
        e2e_latency=result.latency_s,
        output_token_logprobs=logprobs,
        item_results=None
        if result.item_results is None
        else [
            ItemResultOut(
                rank=r.rank,
                token_ids=r.token_ids,
                item_ids=r.item_ids,
                item_id=r.item_id,
                is_complete=r.is_complete,
                score=r.score,
            )
            for r in result.item_results
        ],
        catalog_version=result.catalog_version,
    )
    return GenerateResponse(
        text=ids_text(result.output_ids, tokenizer), output_ids=result.output_ids, meta_info=meta
    )
