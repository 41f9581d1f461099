"""Per-request logits processors, in the reference GR server's form:

  {"type": "token_suppress", "token_ids": [...], "phases"?: ["prefill", "decode"],
   "fill_value"?: -inf}                                   aliases: suppress_tokens, bad_tokens
  {"type": "token_bias", "token_bias": {"<id>": bias}, "phases"?: [...]}   alias: bias_tokens

They act on each step's log-probabilities after the softmax (as transformers' logits processors
do in beam search), before the catalog mask and the choice of tokens: a suppressed token gets
`fill_value`, a biased one its log-probability plus the bias. "prefill" is the first output
token (chosen from the prefill), "decode" every later one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grctl.errors import ValidationError

SUPPRESS_TYPES = ("token_suppress", "suppress_tokens", "bad_tokens")
BIAS_TYPES = ("token_bias", "bias_tokens")
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class LogitsRule:
    token_ids: tuple[int, ...]
    values: tuple[float, ...]  # suppress: the value set; bias: the value added
    is_bias: bool
    phases: tuple[str, ...] = PHASES


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: object, what: str) -> float:
    if isinstance(x, str) and x.strip().lower() in ("-inf", "-infinity"):
        return -math.inf
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or x == math.inf:
        raise ValidationError(f"{what} must be a number (or -inf), got {x!r}")
    return float(x)


def parse_logits_processors(specs: object) -> tuple[LogitsRule, ...]:
    """A request's `logits_processors` list -> rules; ValidationError naming what is wrong."""
    if specs is None:
        return ()
    if not isinstance(specs, list):
        raise ValidationError('logits_processors must be a list of {"type": ...} objects')
    rules = []
    for i, spec in enumerate(specs):
        where = f"logits_processors[{i}]"
        if not isinstance(spec, dict):
            raise ValidationError(f'{where} must be an object with a "type"')
        kind = spec.get("type")
        phases = spec.get("phases", list(PHASES))
        if not isinstance(phases, list) or not all(p in PHASES for p in phases):
            raise ValidationError(f'{where}.phases must be a list of "prefill" and "decode"')
        if kind in SUPPRESS_TYPES:
            ids = spec.get("token_ids")
            if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                raise ValidationError(f'{where} ({kind}) needs "token_ids": a list of ints')
            fill = _number(spec.get("fill_value", -math.inf), f"{where}.fill_value")
            rules.append(LogitsRule(tuple(ids), (fill,) * len(ids), False, tuple(phases)))
        elif kind in BIAS_TYPES:
            bias = spec.get("token_bias", spec.get("bias"))
            if not isinstance(bias, dict):
                raise ValidationError(f'{where} ({kind}) needs "token_bias": {{"<id>": bias}}')
            ids, values = [], []
            for key, value in bias.items():
                try:
                    ids.append(int(key))
                except ValueError:
                    raise ValidationError(f"{where}: {key!r} is not a token id") from None
                values.append(_number(value, f"{where}.token_bias[{key!r}]"))
            rules.append(LogitsRule(tuple(ids), tuple(values), True, tuple(phases)))
        else:
            known = ", ".join(SUPPRESS_TYPES + BIAS_TYPES)
            raise ValidationError(f"{where}: unknown type {kind!r}; use one of {known}")
    return tuple(rules)


def check_token_range(rules: tuple[LogitsRule, ...], vocab_size: int) -> None:
    for rule in rules:
        bad = next((t for t in rule.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValidationError(
                f"logits_processors name token {bad}, outside the vocabulary [0, {vocab_size})"
            )


def apply_rules(
    rows: torch.Tensor, lse: torch.Tensor, rules: tuple[LogitsRule, ...], phase: str
) -> None:
    """rows [r, vocab] logits of one request (log-probabilities + lse [r]), changed in place."""
    for rule in rules:
        if phase not in rule.phases or not rule.token_ids:
            continue
        idx = torch.tensor(rule.token_ids, device=rows.device)
        values = torch.tensor(rule.values, dtype=rows.dtype, device=rows.device)
        if rule.is_bias:
            rows.index_add_(1, idx, values.expand(rows.shape[0], -1).contiguous())
        else:
            rows[:, idx] = values + lse[:, None].to(rows.dtype)
