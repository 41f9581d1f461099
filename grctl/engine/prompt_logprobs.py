"""Prompt scoring: the log-probability of each prompt token given the tokens before it.

A request with return_logprob and logprob_start_len s >= 0 gets SGLang's input_token_logprobs:
one entry per prompt token from index s on, the first without a logprob (None: its logits are
those of the token before it, which is not scored), entry j the model's log-probability of
token s + j at position s + j - 1. These are of the model's raw distribution (log_softmax of the
logits, temperature 1, no catalog mask, no processors): the prompt was not sampled. With
max_new_tokens 0 nothing is generated (the reply carries the scores alone); with more, the
prompt is scored and the request generates as usual (score a continuation: send prompt +
candidate with s = len(prompt) - 1, so that every candidate token gets a logprob).

The prefix cache serves at most the first s tokens of such a prompt (the positions scored are
computed), so many candidates after one shared prompt share its KV. The logits of the scored
positions are never held whole: the vocabulary projection runs over chunks of rows
(CHUNK_ELEMENTS logits at a time), each reduced at once to its token's logprob and top-k; what a
request holds for its scores counts in its memory estimate (--max-kv-bytes), and a request
asking more than MAX_ENTRIES numbers back is refused at submit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grctl.engine.request import GenerateRequest, PromptLogprobs
from grctl.model.qwen3 import Qwen3ForCausalLM

CHUNK_ELEMENTS = 1 << 22  # fp32 logits computed at once: 16 MiB
MAX_ENTRIES = 1 << 21  # scored tokens x (1 + top_logprobs_num) one request may ask back


@dataclass(eq=False)
class Scoring:
    """What a prefill computes for one prompt's scores: the last `rows` positions before its
    last token, each scoring the token after it; the runner fills `logprobs` and `top`."""

    rows: int
    top_k: int = 0
    logprobs: torch.Tensor | None = None  # [rows] float32
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # [rows, top_k] values and ids


def start_of(req: GenerateRequest) -> int | None:
    """The first prompt index scored, or None when the reply holds no prompt entry."""
    start = req.logprob_start_len
    if not req.return_logprob or start < 0 or start >= len(req.input_ids):
        return None
    return start


def num_rows(req: GenerateRequest) -> int:
    """The positions whose logits are computed for the scores (all entries but the first)."""
    start = start_of(req)
    return 0 if start is None else len(req.input_ids) - 1 - start


def num_entries(req: GenerateRequest) -> int:
    """The numbers a request's scores send back: each scored token's, and its top-k."""
    return num_rows(req) * (1 + req.top_logprobs_num)


def cache_limit(req: GenerateRequest) -> int | None:
    """The most prompt tokens the prefix cache may serve (None: any): not the scored ones."""
    return start_of(req)


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def bytes_of(req: GenerateRequest, vocab_size: int, hidden_size: int) -> int:
    """What scoring a prompt holds on the device beside its KV: the last layer's hidden rows
    of the scored positions, a chunk of fp32 logits with its reductions, and the scores."""
    rows = num_rows(req)
    if rows == 0:
        return 0
    chunk = min(rows, chunk_rows(vocab_size))
    return 4 * (2 * rows * hidden_size + 3 * chunk * vocab_size + 3 * num_entries(req))


def score(
    model: Qwen3ForCausalLM, hidden: torch.Tensor, targets: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """hidden [rows, hidden] (the last layer's, before the final norm), targets [rows] (the
    token after each row) -> each target's log-probability [rows] in float32 and, with top_k,
    the top_k log-probabilities [rows, top_k] and their ids, computed chunk by chunk of rows."""
    step = chunk_rows(model.config.vocab_size)
    lps, vals, ids = [], [], []
    for lo in range(0, hidden.shape[0], step):
        logits = model.logits(hidden[lo : lo + step])  # fp32 [chunk, vocab]
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        lps.append((logits.gather(1, targets[lo : lo + step, None]) - lse)[:, 0])
        if top_k:
            v, i = logits.topk(top_k, dim=-1)
            vals.append(v - lse)
            ids.append(i)
        del logits, lse
    if not lps:
        return hidden.new_zeros(0, dtype=torch.float32), None
    return torch.cat(lps), (torch.cat(vals), torch.cat(ids)) if top_k else None


def scoring_of(req: GenerateRequest) -> Scoring | None:
    """What a request's prefill must compute for its scores (None: nothing)."""
    if start_of(req) is None:
        return None
    return Scoring(num_rows(req), req.top_logprobs_num)


def assemble(req: GenerateRequest, scoring: Scoring) -> PromptLogprobs:
    """The reply's entries from the scored rows (one copy to the host)."""
    ids = list(req.input_ids[start_of(req) :])
    lp = scoring.logprobs
    values: list[float | None] = [None, *(lp.tolist() if lp is not None else [])]
    tops = None
    if req.top_logprobs_num:
        tops = [None]
        if scoring.top is not None:
            rows = zip(*(t.tolist() for t in scoring.top), strict=True)
            tops += [list(zip(v, i, strict=True)) for v, i in rows]
    return PromptLogprobs(ids, values, tops)
