"""The served model's tokenizer, on `tokenizers` and jinja2 alone (transformers is not needed
to serve).

A checkpoint directory's `tokenizer.json` is the tokenizer (its normaliser, pre-tokeniser,
added and special tokens, post-processor and decoder); `tokenizer_config.json` adds the chat
template (or `chat_template.jinja` beside it) and the special tokens a template reads. The chat
template is rendered as transformers renders it: a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now` and a `tojson` that keeps
non-ASCII text. A directory with only a slow tokenizer (`tokenizer.model`, `vocab.json` without
`tokenizer.json`) falls back to transformers' AutoTokenizer when transformers is installed.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("grctl.server")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# special tokens a chat template may read by name (transformers passes the same)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: tokenizer_config.json's (a string, or the entry named
    "default" of a list), else the directory's chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    jinja = directory / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


class ServedTokenizer:
    """encode / decode / apply_chat_template with transformers' meanings, for the fast
    tokenizer a checkpoint directory holds."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        directory = Path(directory)
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg_path = directory / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = _chat_template(directory, config)
        self.special_tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self._env: Any = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        # spaces_between_special_tokens: read by transformers' slow tokenizers only
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:  # transformers' clean_up_tokenization
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ",")):
                text = text.replace(before, after)
            for before, after in ((" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), (" 's", "'s")):
                text = text.replace(before, after)
            text = text.replace(" 've", "'ve").replace(" 're", "'re")
        return text

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        if self._env is None:
            self._env = _environment()
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(kwargs)
        text = self._env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _environment() -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def load_tokenizer(model_path: str | None) -> Any | None:
    """The checkpoint's tokenizer, or None when its directory holds none (ids-only serving)."""
    if model_path is None:
        return None
    directory = Path(model_path)
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        if (directory / "tokenizer.json").is_file():
            return ServedTokenizer(directory)
        from transformers import AutoTokenizer  # a slow tokenizer only: transformers' loader

        return AutoTokenizer.from_pretrained(model_path)
    except ImportError:
        log.warning(
            "no tokenizer: %s holds no tokenizer.json, and a slow tokenizer needs transformers "
            "(pip install transformers)",
            model_path,
        )
        return None
    except Exception as exc:  # a broken tokenizer must not stop ids-only serving
        log.warning("no tokenizer: cannot load one from %s: %s", model_path, exc)
        return None
