"""Request checks at submit: everything a client can get wrong is a ValidationError that says
what to change, raised before the request is queued."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grctl.catalog.exclusions import excluded_nodes, excluded_set, unknown_ids
from grctl.catalog.resume import ROOT, ItemStart, item_start
from grctl.engine import prompt_logprobs
from grctl.engine.request import GenerateRequest
from grctl.engine.search.logits_processors import check_token_range
from grctl.errors import ValidationError
from grctl.model.config import ModelConfig

if TYPE_CHECKING:
    from grctl.catalog.store import Catalog

MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 32  # SGLang's limit
MAX_EXCLUDED_ITEMS = 100_000
# top logprobs one request may ask (k x beams x new tokens): 12 MiB of tensors while it runs
MAX_TOP_LOGPROB_ENTRIES = 1 << 20
# Each beam ranks 1 + len(stop ids) candidates per step: bounded, like the stop strings.
MAX_STOP_TOKEN_IDS = 64
# Sampling knobs are computed in float32 (logits / temperature, score / length ** penalty):
# past these a value overflows to inf or ties every candidate; no sampler needs more.
MAX_TEMPERATURE = 100.0
MAX_LENGTH_PENALTY = 10.0
MAX_TOP_K = 2**31 - 1  # SGLang's "whole vocabulary" spelling (1 << 30) fits


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
    if not _is_int(sp.max_new_tokens) or not 0 <= sp.max_new_tokens <= max_new_tokens_limit:
        raise ValidationError(
            f"max_new_tokens must be in [0, {max_new_tokens_limit}] (0: score or cache the "
            f"prompt only), got {sp.max_new_tokens!r}"
        )
    if len(ids) + sp.max_new_tokens > max_context_len:
        raise ValidationError(
            f"prompt of {len(ids)} tokens + max_new_tokens {sp.max_new_tokens} exceeds the "
            f"context limit of {max_context_len} tokens; shorten the prompt"
        )
    _check_search(req, vocab, max_beam_width)
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValidationError(
            f"stop_token_ids holds {len(sp.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
            "are allowed"
        )
    bad = next((t for t in sp.stop_token_ids if not _is_int(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValidationError(f"stop_token_ids holds {bad!r}, not a token id in [0, {vocab})")
    check_token_range(sp.logits_processors, vocab)


def _number_in(value: object, lo: float, hi: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi


def check_temperature(value: object, name: str = "temperature") -> None:
    """The float32 bound of a temperature; `name`: the field the client sent it as."""
    if not _number_in(value, 0.0, MAX_TEMPERATURE):
        raise ValidationError(f"{name} must be a number in [0, {MAX_TEMPERATURE:g}], got {value!r}")


def check_top_k(value: object, name: str = "top_k") -> None:
    if not _is_int(value) or not (value == -1 or 1 <= value <= MAX_TOP_K):
        raise ValidationError(
            f"{name} must be -1 (whole vocab) or in [1, {MAX_TOP_K}], got {value!r}"
        )


def check_length_penalty(value: object, name: str = "length_penalty") -> None:
    if not _number_in(value, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY):
        raise ValidationError(
            f"{name} must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
            f"got {value!r}"
        )


def _check_search(req: GenerateRequest, vocab: int, max_beam_width: int) -> None:
    sp = req.sampling
    width_limit = min(max_beam_width, vocab)
    if sp.beam_width is None:
        if not _is_int(sp.n) or not 1 <= sp.n <= width_limit:
            raise ValidationError(f"n (beam width) must be in [1, {width_limit}], got {sp.n!r}")
    else:
        if not _is_int(sp.beam_width) or not 1 <= sp.beam_width <= width_limit:
            raise ValidationError(
                f"beam_width must be in [1, {width_limit}], got {sp.beam_width!r}"
            )
        if not _is_int(sp.n) or not 1 <= sp.n:
            raise ValidationError(f"n must be at least 1, got {sp.n!r}")
        if sp.n > sp.beam_width:
            raise ValidationError(f"n ({sp.n}) cannot exceed beam_width ({sp.beam_width}).")
    check_temperature(sp.temperature)
    if not isinstance(sp.top_p, (int, float)) or not 0 < sp.top_p <= 1:
        raise ValidationError(f"top_p must be in (0, 1], got {sp.top_p!r}")
    check_top_k(sp.top_k)
    if not _number_in(sp.min_p, 0.0, 1.0):
        raise ValidationError(f"min_p must be in [0, 1], got {sp.min_p!r}")
    if sp.seed is not None and not (_is_int(sp.seed) and -(2**63) <= sp.seed < 2**64):
        raise ValidationError(f"seed must be a 64-bit integer, got {sp.seed!r}")
    if not _is_int(sp.min_new_tokens) or not 0 <= sp.min_new_tokens <= sp.max_new_tokens:
        raise ValidationError(
            f"min_new_tokens must be in [0, max_new_tokens ({sp.max_new_tokens})], "
            f"got {sp.min_new_tokens!r}"
        )
    check_length_penalty(sp.length_penalty)
    if sp.length_penalty != 0 and (sp.width == 1 or sp.is_stochastic):
        raise ValidationError(
            "length_penalty ranks the finished beams of a deterministic beam search: it needs "
            "more than one beam and temperature 0"
        )
    _check_stop_strings(req)
    if not _is_int(req.top_logprobs_num) or not 0 <= req.top_logprobs_num <= vocab:
        raise ValidationError(
            f"top_logprobs_num must be in [0, {vocab}], got {req.top_logprobs_num!r}"
        )
    entries = req.top_logprobs_num * sp.width * sp.max_new_tokens if req.return_logprob else 0
    if entries > MAX_TOP_LOGPROB_ENTRIES:
        raise ValidationError(
            f"top_logprobs_num {req.top_logprobs_num} x {sp.width} beams x {sp.max_new_tokens} "
            f"tokens is {entries} entries; at most {MAX_TOP_LOGPROB_ENTRIES} per request",
            hint="ask fewer top logprobs, beams or new tokens",
        )
    _check_prompt_scores(req)


def _check_prompt_scores(req: GenerateRequest) -> None:
    start, num = req.logprob_start_len, len(req.input_ids)
    if not _is_int(start) or not -1 <= start <= num:
        raise ValidationError(
            f"logprob_start_len must be -1 (no prompt logprobs) or an index in [0, {num}] of "
            f"the prompt of {num} tokens, got {start!r}"
        )
    entries = prompt_logprobs.num_entries(req)
    if entries > prompt_logprobs.MAX_ENTRIES:
        raise ValidationError(
            f"scoring {prompt_logprobs.num_rows(req)} prompt tokens with top_logprobs_num "
            f"{req.top_logprobs_num} asks {entries} logprobs back, more than "
            f"{prompt_logprobs.MAX_ENTRIES}",
            hint="raise logprob_start_len, lower top_logprobs_num, or split the prompt",
        )


def _check_stop_strings(req: GenerateRequest) -> None:
    stop = req.sampling.stop
    if not stop:
        return
    if len(stop) > MAX_STOP_STRINGS:
        raise ValidationError(
            f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}"
        )
    if not all(isinstance(s, str) and s for s in stop):
        raise ValidationError("stop must be a non-empty string or a list of them")
    if req.sampling.width > 1:
        raise ValidationError(
            "Beam search does not support stop strings/regex yet; use stop_token_ids."
        )
    if req.detokenize is None:
        raise ValidationError(
            "stop strings need a tokenizer in the model directory",
            hint="send stop_token_ids, or serve a --model-path that holds tokenizer files",
        )


def excluded_of(
    req: GenerateRequest, catalog: Catalog | None, device: torch.device, start_depth: int = 0
) -> tuple:
    """(the catalog nodes a request's exclude_item_ids close, on the device, those ids as
    the catalog spells them, and the ids it sent that name no item); (None, frozenset(), ())
    when it excludes nothing. A request whose item starts at `start_depth` counts only the
    items min_new_tokens leaves it."""
    ids = req.sampling.exclude_item_ids
    if not ids:
        return None, frozenset(), ()
    if catalog is None:
        raise ValidationError(
            "exclude_item_ids needs the served item catalog",
            hint="start the server with --catalog, and leave use_catalog true",
        )
    if len(ids) > MAX_EXCLUDED_ITEMS:
        raise ValidationError(
            f"exclude_item_ids holds {len(ids)} ids; at most {MAX_EXCLUDED_ITEMS} are allowed"
        )
    min_depth = start_depth + req.sampling.min_new_tokens
    nodes = torch.from_numpy(excluded_nodes(catalog, ids, min_depth)).to(device)
    return nodes, frozenset(excluded_set(catalog, ids)), tuple(unknown_ids(catalog, ids))


def item_start_of(req: GenerateRequest, catalog: Catalog | None) -> ItemStart:
    """Where the request's item starts in the catalog (catalog/resume.py): the root, or inside
    the partial item its prompt ends with."""
    pinned = req.sampling.item_prefix_len
    if catalog is None:
        if pinned:
            raise ValidationError(
                "item_prefix_len needs the served item catalog",
                hint="start the server with --catalog, and leave use_catalog true",
            )
        return ROOT
    return item_start(catalog.trie, req.input_ids, pinned)


def stop_ids_of(req: GenerateRequest, cfg: ModelConfig) -> tuple[int, ...]:
    """The tokens that end a sequence: EOS plus stop_token_ids, none with ignore_eos."""
    if req.sampling.ignore_eos:
        return ()
    return tuple(dict.fromkeys((*cfg.eos_token_ids, *req.sampling.stop_token_ids)))


def context_limit(asked: int, model_config) -> int:
    """--max-context-len (0: the checkpoint's own limit), never past the positions the
    checkpoint covers: max_position_embeddings, or its RoPE scaling's window (original x
    factor) when that is longer. SGLang refuses a longer context the same way."""
    limit, rope = model_config.max_position_embeddings, model_config.rope
    if rope.rope_type != "default":
        limit = max(limit, int(rope.original_max_position_embeddings * rope.factor))
    if asked > limit:
        raise ValidationError(
            f"--max-context-len {asked} is longer than the checkpoint's {limit} positions "
            f"(max_position_embeddings {model_config.max_position_embeddings})",
            hint=f"pass --max-context-len {limit} or less, or 0 for the checkpoint's own limit",
        )
    return asked or limit
