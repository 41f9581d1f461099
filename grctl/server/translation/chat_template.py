"""The chat template, rendered for /v1/chat/completions: messages -> the prompt's token ids.

Only the served model's own template runs, with the assistant's turn opened and the documented
reasoning switches a client may set (TEMPLATE_KWARGS); a client's own template, tools or any
other template argument is a 400 before anything renders, and so is a template that refuses the
messages. Rendering and tokenizing are CPU work on the request's text: the route runs
`chat_prompt` through offload(), after `check_chat` refused what it refuses.
"""

from __future__ import annotations

from typing import Any

from grctl.errors import ValidationError
from grctl.protocol.openai import ChatCompletionBody
from grctl.server.translation.openai import needs_tokenizer, top_logprobs_of

try:  # what a chat template raises (jinja2 comes with transformers' chat templates)
    from jinja2.exceptions import TemplateError
except ImportError:  # pragma: no cover - then apply_chat_template cannot run either
    TemplateError = RuntimeError  # type: ignore[misc,assignment]

# chat_template_kwargs a client may send, as SGLang and vLLM document them for reasoning models
# (Qwen3's enable_thinking, DeepSeek's thinking, gpt-oss's reasoning_effort): each a value the
# template only reads. Anything else (a template of the client's own, tools, tokenize,
# add_generation_prompt, ...) is a 400: the server renders its own template with its own
# arguments, so no request can make it run code of its choosing or render something else.
TEMPLATE_KWARGS: dict[str, tuple[type, tuple[Any, ...]]] = {
    "enable_thinking": (bool, ()),
    "thinking": (bool, ()),
    "reasoning_effort": (str, ("low", "medium", "high")),
}


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The documented chat_template_kwargs, each checked; a 400 for any other key or value."""
    out: dict[str, Any] = {}
    for key, value in (kwargs or {}).items():
        shown = key if len(key) <= 40 else key[:40] + "..."
        if key == "chat_template":
            raise ValidationError(
                "chat_template_kwargs.chat_template: grctl renders only the served model's own "
                "chat template",
                hint="put the template in the model directory's tokenizer_config.json, or send "
                "the prompt already formatted to /v1/completions",
            )
        if key in ("tools", "documents"):
            raise ValidationError(f"{key} are not supported (in chat_template_kwargs neither)")
        rule = TEMPLATE_KWARGS.get(key)
        if rule is None:
            raise ValidationError(
                f"chat_template_kwargs.{shown} is not supported",
                hint="send only " + ", ".join(TEMPLATE_KWARGS),
            )
        kind, allowed = rule
        if type(value) is not kind or (allowed and value not in allowed):
            want = " | ".join(map(repr, allowed)) if allowed else kind.__name__
            raise ValidationError(f"chat_template_kwargs.{key} must be {want}")
        out[key] = value
    return out


def message_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValidationError(
                f"message content of type {part.get('type')!r} is not supported; send text"
            )
        parts.append(part["text"])
    return "".join(parts)


def check_chat(body: ChatCompletionBody) -> dict[str, Any]:
    """What a chat body may not hold, refused before any templating; its template kwargs."""
    if not body.messages:
        raise ValidationError("messages is required and may not be empty")
    if body.tools:
        raise ValidationError("tools are not supported")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise ValidationError("only response_format {'type': 'text'} is supported")
    top_logprobs_of(body.top_logprobs, body.logprobs, "top_logprobs")
    return template_kwargs(body.chat_template_kwargs)


def chat_prompt(body: ChatCompletionBody, tokenizer: Any | None) -> list[int]:
    """The messages through the tokenizer's chat template, with the assistant's turn opened.
    CPU work on the request's text: the routes run it through offload()."""
    kwargs = check_chat(body)
    tok = needs_tokenizer(tokenizer, "chat")
    if not isinstance(getattr(tok, "chat_template", None), str) or not tok.chat_template:
        raise ValidationError(
            "the model's tokenizer has no chat template",
            hint="use /v1/completions with the prompt already formatted",
        )
    messages = [{"role": m.role, "content": message_text(m.content)} for m in body.messages]
    try:
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        # the served template refused these messages (raise_exception, roles out of order...)
        raise ValidationError(
            f"the chat template cannot render these messages: {str(exc)[:200]}"
        ) from None
    if not isinstance(text, str):
        raise ValidationError("the chat template did not render text")
    return list(tok.encode(text, add_special_tokens=False))
