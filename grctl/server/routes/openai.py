"""OpenAI-compatible routes, as SGLang and vLLM serve them: /v1/models, /v1/completions and
/v1/chat/completions, in one reply or as server-sent events (`stream: true`).

Each request runs as /generate's do (server/translation/openai.py converts): the same engine call,
so the same catalog, logprobs and refusals (paused, weights mixed, memory released answer 503
before any stream starts). A stream is sent once the requests have finished: GR replies are a
few tokens, and beams are only known whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import msgspec
from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.params import Body
from litestar.response import Stream

from grctl.errors import NotFound
from grctl.errors import ValidationError as BadRequest
from grctl.protocol.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionBody,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    CompletionBody,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ModelCard,
    ModelList,
    TokenLogprob,
)
from grctl.server.disconnect import unless_disconnected
from grctl.server.offload import offload, offload_json
from grctl.server.openapi import error_responses
from grctl.server.routes.generate import run_to_end, staged_to_end
from grctl.server.routes.info import served_model_name
from grctl.server.translation.chat_template import chat_prompt, check_chat
from grctl.server.translation.generate import to_requests
from grctl.server.translation.openai import (
    Choice,
    choices_of,
    completion_prompts,
    created_now,
    metadata_of,
    num_prompts,
    refuse_unserved,
    requests_of,
    top_logprobs_of,
    usage_of,
)
from grctl.server.translation.openai_stages import (
    is_staged,
    staged_body,
    staged_choices,
    staged_metadata,
    staged_usage,
)

STARTED = created_now()  # the model cards' `created`


def model_card(state: State) -> ModelCard:
    return ModelCard(
        id=served_model_name(state),
        created=STARTED,
        root=state.model_path,
        max_model_len=state.engine.max_context_len,
    )


@get("/v1/models", summary="The served model, as OpenAI's model list")
async def list_models(state: State) -> ModelList:
    return ModelList(data=[model_card(state)])


@get("/v1/models/{model:path}", summary="The served model's card; 404 for any other name")
async def get_model(state: State, model: str) -> ModelCard:
    card = model_card(state)
    if model.lstrip("/") != card.id.lstrip("/"):
        raise NotFound(f"the model {model.lstrip('/')!r} does not exist", hint=f"use {card.id!r}")
    return card


async def run(
    state: State,
    request: Request,
    body,
    rows,
    max_new_tokens: int,
    logprobs: bool,
    top: int,
    echo: bool = False,
):
    reqs = requests_of(body, rows, max_new_tokens, logprobs, top, echo)
    results = await unless_disconnected(request, lambda: run_to_end(state, reqs))
    # detokenizing every beam (and its alternatives) is CPU work: off the event loop
    echo_rows = rows if echo else None
    choices = await offload(
        state, choices_of, results, state.tokenizer, body.skip_special_tokens, echo_rows
    )
    return results, choices


async def run_staged(state, request, body, rows, max_new_tokens: int, logprobs: bool, top: int):
    """A multi-stage body (openai_stages.py): (rid, usage, metadata, choices)."""
    if top:
        raise BadRequest("top logprobs (alternatives) are not served for multi-stage requests")
    gbody = staged_body(body, rows, max_new_tokens, logprobs)
    reqs, _ = await offload(state, to_requests, gbody, state.tokenizer)
    replies = await staged_to_end(state, request, reqs)
    choices = await offload(
        state, staged_choices, replies, state.tokenizer, body.skip_special_tokens
    )
    return replies[0].meta_info.id, staged_usage(replies), staged_metadata(replies), choices


def sse(chunks: list[msgspec.Struct]) -> Stream:
    def events() -> Iterator[bytes]:
        for chunk in chunks:
            yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return Stream(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def completion_logprobs(choice: Choice) -> CompletionLogprobs | None:
    if choice.logprobs is None:
        return None
    top = choice.top or [None] * len(choice.logprobs)  # None: no alternatives were asked
    return CompletionLogprobs(
        tokens=[t for t, _ in choice.logprobs],
        token_logprobs=[lp for _, lp in choice.logprobs],
        top_logprobs=[None if alts is None else dict(alts) for alts in top],
        text_offset=[-1] * len(choice.logprobs),
    )


@post(
    "/v1/completions",
    status_code=200,
    summary="OpenAI completions: prompt as text or token ids; n > 1 is beam search",
    responses=error_responses(400, 409, 413, 429, 503, 504),
)
async def completions(
    state: State, request: Request, data: Annotated[CompletionBody | None, Body()] = None
) -> Response:
    body = data or CompletionBody()
    refuse_unserved(body)
    top = top_logprobs_of(body.logprobs, True, "logprobs") if body.logprobs is not None else 0
    state.engine.check_batch_fits(num_prompts(body))  # before a prompt is tokenized
    rows = await offload(state, completion_prompts, body, state.tokenizer)
    if is_staged(body):
        logprobs = body.logprobs is not None
        rid, usage, metadata, choices = await run_staged(
            state, request, body, rows, body.max_tokens, logprobs, top
        )
    else:
        results, choices = await run(
            state, request, body, rows, body.max_tokens, body.logprobs is not None, top, body.echo
        )
        rid, usage, metadata = results[0].request_id, usage_of(results), metadata_of(results)
    head = {"id": f"cmpl-{rid}", "created": created_now(), "model": body.model}
    if not body.stream:  # a large reply (an echo with logprobs): built and encoded off the loop
        return await offload_json(state, completion_reply, head, choices, usage, metadata)
    out = await offload(state, completion_choices, choices)
    chunks: list[msgspec.Struct] = [CompletionResponse(**head, choices=[c]) for c in out]
    if body.stream_options and body.stream_options.include_usage:
        chunks.append(CompletionResponse(**head, choices=[], usage=usage))
    return sse(chunks)


def completion_choices(choices: list[Choice]) -> list[CompletionChoice]:
    return [
        CompletionChoice(
            index=c.index,
            text=c.text,
            logprobs=completion_logprobs(c),
            finish_reason=c.finish_reason,
            matched_stop=c.matched_stop,
            meta_info=c.meta,
        )
        for c in choices
    ]


def completion_reply(head: dict, choices: list[Choice], usage, metadata) -> CompletionResponse:
    return CompletionResponse(
        **head, choices=completion_choices(choices), usage=usage, metadata=metadata
    )


def chat_reply(head: dict, choices: list[Choice], usage, metadata) -> ChatCompletionResponse:
    out = [
        ChatChoice(
            index=c.index,
            message=ChatMessageOut(content=c.text),
            logprobs=chat_logprobs(c),
            finish_reason=c.finish_reason,
            matched_stop=c.matched_stop,
            meta_info=c.meta,
        )
        for c in choices
    ]
    return ChatCompletionResponse(**head, choices=out, usage=usage, metadata=metadata)


def chat_logprobs(choice: Choice) -> ChatLogprobs | None:
    if choice.logprobs is None:
        return None
    top = choice.top or [[] for _ in choice.logprobs]
    return ChatLogprobs(
        content=[
            TokenLogprob(
                token=t,
                bytes=list(t.encode()),
                logprob=lp,
                top_logprobs=[
                    {"token": a, "bytes": list(a.encode()), "logprob": alp} for a, alp in alts
                ],
            )
            for (t, lp), alts in zip(choice.logprobs, top, strict=False)
        ]
    )


@post(
    "/v1/chat/completions",
    status_code=200,
    summary="OpenAI chat completions, through the tokenizer's chat template",
    responses=error_responses(400, 409, 413, 429, 503, 504),
)
async def chat_completions(
    state: State, request: Request, data: Annotated[ChatCompletionBody | None, Body()] = None
) -> Response:
    body = data or ChatCompletionBody()
    refuse_unserved(body)
    check_chat(body)  # the refusals first, then the template off the event loop
    prompt = await offload(state, chat_prompt, body, state.tokenizer)
    top = top_logprobs_of(body.top_logprobs, body.logprobs, "top_logprobs")
    cfg = state.config.engine
    max_new = body.max_completion_tokens or body.max_tokens
    if is_staged(body):
        if max_new is None:
            raise BadRequest(
                "a multi-stage chat request needs max_tokens (or max_completion_tokens): the "
                "item stage's length"
            )
        rid, usage, metadata, choices = await run_staged(
            state, request, body, [prompt], max_new, body.logprobs, top
        )
    else:
        if max_new is None:  # the server's limit, within the context left after the prompt
            max_new = max(1, min(cfg.max_new_tokens, state.engine.max_context_len - len(prompt)))
        results, choices = await run(state, request, body, [prompt], max_new, body.logprobs, top)
        rid, usage, metadata = results[0].request_id, usage_of(results), metadata_of(results)
    head = {
        "id": f"chatcmpl-{rid}",
        "created": created_now(),
        "model": body.model,
    }
    if not body.stream:  # built and encoded off the loop
        return await offload_json(state, chat_reply, head, choices, usage, metadata)
    # Per choice, as SGLang streams: the role, the content, then the finish on its own.
    chunks: list[msgspec.Struct] = []
    for c in choices:
        for choice in (
            ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content="")),
            ChatChunkChoice(
                index=c.index, delta=ChatDelta(content=c.text), logprobs=chat_logprobs(c)
            ),
            ChatChunkChoice(
                index=c.index,
                finish_reason=c.finish_reason,
                matched_stop=c.matched_stop,
                meta_info=c.meta,
            ),
        ):
            chunks.append(ChatCompletionChunk(**head, choices=[choice]))
    if body.stream_options and body.stream_options.include_usage:
        chunks.append(ChatCompletionChunk(**head, choices=[], usage=usage))
    return sse(chunks)


openai_routes = [list_models, get_model, completions, chat_completions]
