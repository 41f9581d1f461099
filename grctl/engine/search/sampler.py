"""Sampling, batched over rows: the distribution a sampled token comes from, the draw of one
token, and the Gumbel perturbation that samples several distinct sequences at once.

A sampled row's distribution is log_softmax(x / T) over what the row allows (the vocabulary, or a
catalog node's children), x being the step's log-probabilities after the request's processors.
The filters follow SGLang's: top-k keeps the k most likely tokens, top-p the most likely ones
until the mass before a token exceeds p (the first is always kept), min-p the tokens at least
min_p times as likely as the most likely one, all three judged on that tempered distribution;
what they drop is -inf, and the rest is renormalised.

Width 1 draws one token by inverse CDF from one uniform per row. Width w > 1 is stochastic beam
search (Kool, van Hoof and Welling, 2019): every prefix carries phi, its log-probability under
the sampling distribution, and a key, a Gumbel(phi) sample conditioned on its parent's key being
the largest of its children's keys, the root's own key a Gumbel(0) draw (so every complete
sequence's key is an independent Gumbel(log q) sample, and a threshold's inclusion
probabilities hold); the w largest keys of each step are a sample without replacement of w
prefixes, and at the end of w distinct sequences.

Every stochastic request owns a torch.Generator seeded by its `seed`, and draws its uniforms for
one step in one call, so its samples do not depend on what it was batched with.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

NEG_INF = float("-inf")
_LOG_HALF = -math.log(2.0)


# deterministic inference: every row's reductions alone, so a row's sum does not follow how many
# rows share the call (a reduction over [rows, vocab] is split by its shape: a request's score
# differed in its last bits alone and in a batch at a 50,000-token vocabulary)
_ROW_INVARIANT = contextvars.ContextVar("row_invariant", default=False)


@contextmanager
def row_invariant(on: bool) -> Iterator[None]:
    """Inside: row_logsumexp reduces each row in a call of its own (the selection of a step run
    under --enable-deterministic-inference)."""
    token = _ROW_INVARIANT.set(on)
    try:
        yield
    finally:
        _ROW_INVARIANT.reset(token)


def row_logsumexp(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """log(sum(exp(x))) over the last dim: torch.logsumexp's value at a fraction of its CPU cost
    (9.6 ms against 0.3 ms for [128, 1024] on this project's CPU); a row all -inf gives -inf."""
    if _ROW_INVARIANT.get() and x.dim() == 2 and x.shape[0] > 1:
        out = torch.cat([_logsumexp(x[i : i + 1]) for i in range(x.shape[0])])
    else:
        out = _logsumexp(x)
    return out if keepdim else out.squeeze(-1)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    m = x.amax(-1, keepdim=True)
    m = m.masked_fill(~torch.isfinite(m), 0.0)
    return (x - m).exp_().sum(-1, keepdim=True).log_().add_(m)


def sampling_logprobs(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    filters: tuple[bool, int, bool],
) -> torch.Tensor:
    """x [r, m] log-probabilities (-inf: not allowed); per row temperature (> 0), top_k (>= m:
    off), top_p, min_p [r]; `filters`, known on the host: (any min_p, the largest top_k in
    use or 0, any top_p). Returns the renormalised sampling log-probabilities [r, m]."""
    any_min_p, max_top_k, any_top_p = filters
    m = x.shape[1]
    lp = torch.log_softmax(x / temperature[:, None], dim=-1)
    lp = torch.nan_to_num(lp, nan=NEG_INF, neginf=NEG_INF)  # a row with nothing allowed
    if not (any_min_p or any_top_p or 0 < max_top_k < m):
        return lp  # no filter: nothing to drop or renormalise
    keep = torch.ones_like(lp, dtype=torch.bool)
    if any_min_p:
        floor = lp.max(-1, keepdim=True).values + torch.log(min_p)[:, None]
        keep &= lp >= floor
    uses_k = top_k < m
    if any_top_p:
        sorted_lp, order = lp.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        drop = torch.arange(m, device=x.device)[None] >= top_k[:, None]
        drop |= probs.cumsum(-1) - probs > top_p[:, None]
        keep &= torch.empty_like(drop).scatter_(1, order, ~drop)
    elif 0 < max_top_k < m:
        k = torch.where(uses_k, top_k, 1)
        kth = lp.topk(max_top_k, dim=-1).values.gather(1, (k - 1)[:, None])
        keep &= lp >= torch.where(uses_k[:, None], kth, NEG_INF)
    lp = lp.masked_fill(~keep, NEG_INF)
    return torch.nan_to_num(lp - row_logsumexp(lp, keepdim=True), nan=NEG_INF, neginf=NEG_INF)


def draw_one(lp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of lp [r, m] with probability exp(lp), from uniforms u [r] in [0, 1)."""
    cdf = lp.exp().cumsum(-1)
    # `right`: a token of probability 0 (a flat step of the CDF) is never the answer
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return idx.squeeze(1).clamp(max=lp.shape[1] - 1)


def gumbel(phi: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Gumbel(phi) samples [r, m] from uniforms u [r, m] in [0, 1)."""
    u = u.clamp(min=torch.finfo(u.dtype).tiny)
    return phi - torch.log(-torch.log(u))


def conditioned(g: torch.Tensor, z: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """Children's keys: Gumbel samples g [r, m] (their row maximum z [r]) shifted so that the
    row's largest equals the parent's key [r], keeping their joint law (Kool et al., eq. 23)."""
    target, z = parent[:, None], z[:, None]
    a = g - z  # <= 0
    log1mexp = torch.where(a > _LOG_HALF, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))
    v = target - g + log1mexp
    keys = target - torch.relu(v) - torch.log1p(torch.exp(-v.abs()))
    return torch.where(torch.isfinite(g) & torch.isfinite(target), keys, NEG_INF)


def uniforms(generators: list[torch.Generator], shapes: list[tuple[int, ...]], device) -> list:
    """One draw per generator of the given shape (each request's noise for one step)."""
    return [
        torch.rand(shape, generator=g, device=device)
        for g, shape in zip(generators, shapes, strict=True)
    ]
