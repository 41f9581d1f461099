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

import numpy as np
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


@dataclass(frozen=True)
class TokenEdits:
    """What a request's rules do to one phase's log-probabilities, one entry per token: set
    (log-probability := value) or add (+= value), the rules composed in order."""

    tokens: np.ndarray  # [m] int64
    values: np.ndarray  # [m] float64
    is_set: np.ndarray  # [m] bool

    @classmethod
    def of(cls, rules: tuple[LogitsRule, ...], phase: str) -> TokenEdits:
        net: dict[int, tuple[bool, float]] = {}
        for rule in rules:
            if phase not in rule.phases:
                continue
            for token, value in zip(rule.token_ids, rule.values, strict=True):
                was_set, acc = net.get(token, (False, 0.0))
                net[token] = (was_set, acc + value) if rule.is_bias else (True, value)
        tokens = np.fromiter(net, np.int64, len(net))
        values = np.array([v for _, v in net.values()], np.float64)
        is_set = np.array([s for s, _ in net.values()], bool)
        return cls(tokens, values, is_set)

    def __len__(self) -> int:
        return int(self.tokens.size)


def apply_edits(
    x: torch.Tensor, lse: torch.Tensor, edits: list[tuple[int, int, TokenEdits]]
) -> None:
    """x [rows, vocab] logits (log-probabilities + lse [rows]), changed in place by every
    (first_row, num_rows, edits) in one set and one add for all of them."""
    edits = [(first, n, e) for first, n, e in edits if len(e)]
    if not edits:
        return
    rows = np.concatenate([np.repeat(np.arange(f, f + n), len(e)) for f, n, e in edits])
    tokens = np.concatenate([np.tile(e.tokens, n) for _, n, e in edits])
    values = np.concatenate([np.tile(e.values, n) for _, n, e in edits])
    is_set = np.concatenate([np.tile(e.is_set, n) for _, n, e in edits])
    dev = x.device
    for mask, setting in ((is_set, True), (~is_set, False)):
        if not mask.any():
            continue
        r = torch.from_numpy(rows[mask]).to(dev)
        t = torch.from_numpy(tokens[mask]).to(dev)
        v = torch.from_numpy(values[mask]).to(dev, x.dtype)
        if setting:
            x.index_put_((r, t), v + lse[r].to(x.dtype))
        else:
            x.index_put_((r, t), v, accumulate=True)
