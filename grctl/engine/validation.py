"""Request checks at submit: everything a client can get wrong is a ValidationError that says
what to change, raised before the request is queued."""

from __future__ import annotations

import math

from grctl.engine.request import GenerateRequest
from grctl.engine.search.logits_processors import check_token_range
from grctl.errors import ValidationError
from grctl.model.config import ModelConfig

MAX_REQUEST_ID_LEN = 256


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_request(
    req: GenerateRequest,
    cfg: ModelConfig,
    *,
    max_context_len: int,
    max_beam_width: int,
    max_new_tokens_limit: int,
) -> None:
    rid = req.request_id
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID_LEN):
        raise ValidationError(
            f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} characters"
        )
    ids = req.input_ids
    if not isinstance(ids, (tuple, list)) or len(ids) == 0:
        raise ValidationError("input_ids must be a non-empty list of token ids")
    vocab = cfg.vocab_size
    bad = next((t for t in ids if not _is_int(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValidationError(f"input_ids holds {bad!r}, not a token id in [0, {vocab})")
    sp = req.sampling
    if not _is_int(sp.max_new_tokens) or not 1 <= sp.max_new_tokens <= max_new_tokens_limit:
        raise ValidationError(
            f"max_new_tokens must be in [1, {max_new_tokens_limit}], got {sp.max_new_tokens!r}"
        )
    if len(ids) + sp.max_new_tokens > max_context_len:
        raise ValidationError(
            f"prompt of {len(ids)} tokens + max_new_tokens {sp.max_new_tokens} exceeds the "
            f"context limit of {max_context_len} tokens; shorten the prompt"
        )
    width_limit = min(max_beam_width, vocab)
    if not _is_int(sp.n) or not 1 <= sp.n <= width_limit:
        raise ValidationError(f"n (beam width) must be in [1, {width_limit}], got {sp.n!r}")
    if not isinstance(sp.temperature, (int, float)) or not (
        math.isfinite(sp.temperature) and sp.temperature >= 0
    ):
        raise ValidationError(f"temperature must be a finite number >= 0, got {sp.temperature!r}")
    if not isinstance(sp.top_p, (int, float)) or not 0 < sp.top_p <= 1:
        raise ValidationError(f"top_p must be in (0, 1], got {sp.top_p!r}")
    if not _is_int(sp.top_k) or not (sp.top_k == -1 or sp.top_k >= 1):
        raise ValidationError(f"top_k must be -1 (whole vocab) or >= 1, got {sp.top_k!r}")
    if sp.seed is not None and not (_is_int(sp.seed) and -(2**63) <= sp.seed < 2**64):
        raise ValidationError(f"seed must be a 64-bit integer, got {sp.seed!r}")
    bad = next((t for t in sp.stop_token_ids if not _is_int(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValidationError(f"stop_token_ids holds {bad!r}, not a token id in [0, {vocab})")
    check_token_range(sp.logits_processors, vocab)


def stop_ids_of(req: GenerateRequest, cfg: ModelConfig) -> tuple[int, ...]:
    """The tokens that end a sequence: EOS plus stop_token_ids, none with ignore_eos."""
    if req.sampling.ignore_eos:
        return ()
    return tuple(dict.fromkeys((*cfg.eos_token_ids, *req.sampling.stop_token_ids)))
