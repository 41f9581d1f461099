"""Each request's K best candidates for one step, from the step's processed log-probabilities.

Rows are grouped by what they allow (the vocabulary, or one catalog trie's children) and by how
they choose (deterministic: the best by score; width 1 sampled: one draw; wider sampled: the
largest Gumbel keys), and each group runs as a few batched ops: a top-k or a draw per row, then
the segmented top-k of each request's rows (segments.py). A catalog row gathers its trie node's
children (the widest fan-out at that depth wide), with the padding, the excluded items' nodes
and, before min_new_tokens, the prefixes whose every item would end too soon masked out.

Every candidate also carries its behaviour log-probability: the token's under the distribution
the row chose from (sampled rows: sampler.sampling_logprobs; deterministic rows: the processed
log-probabilities renormalised over what the row allows). When asked, each row's best behaviour
log-probabilities (top logprobs) and its sampling support (the sampled rows' tokens of nonzero
probability, best first) are written per row, -inf past what the row allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grctl.catalog import min_length
from grctl.engine.search import sampler
from grctl.engine.search.row_budget import row_top
from grctl.engine.search.row_tops import RowTops
from grctl.engine.search.segments import segment_topk

NEG_INF = float("-inf")


@dataclass
class Parents:
    """The beam each row of the step extends: score, key, phi [rows] and trie node [rows]."""

    score: torch.Tensor
    key: torch.Tensor
    phi: torch.Tensor
    node: torch.Tensor


@dataclass
class Cands:
    """Every request's candidates, best key first, padded to [R, K] (key -inf: none)."""

    key: torch.Tensor
    score: torch.Tensor
    phi: torch.Tensor
    token: torch.Tensor
    node: torch.Tensor
    row: torch.Tensor  # the step's row of the parent beam
    item_end: torch.Tensor  # the candidate completes a catalog item
    blp: torch.Tensor  # the token's behaviour log-probability (phi's increment)

    @classmethod
    def empty(cls, num: int, k: int, device) -> Cands:
        f = torch.full((num, k), NEG_INF, device=device)
        i = torch.zeros((num, k), dtype=torch.int64, device=device)
        return cls(f, f.clone(), f.clone(), i, i.clone(), i.clone(), i.bool(), f.clone())


@dataclass
class Group:
    """Requests of the step that choose alike: their indices, rows and per-request values."""

    reqs: list[int]  # indices into the step's blocks
    beams: list  # their Beams
    firsts: list[int]
    num_rows: list[int]

    @property
    def rows(self) -> np.ndarray:
        return np.concatenate(
            [np.arange(f, f + n) for f, n in zip(self.firsts, self.num_rows, strict=True)]
        )


def collect(
    x,
    lse,
    par: Parents,
    groups: list[tuple[str, Group]],
    num: int,
    k: int,
    tops: RowTops,
    processed: bool,
) -> Cands:
    """x [rows, vocab] logits, lse [rows] the raw logits' log-sum-exp, `processed` whether x
    holds the processors' edits; groups as (kind, Group), kind one of 'det', 'sample', 'gumbel'.
    Returns the padded candidates of all `num` requests; fills `tops` for the rows that ask."""
    out = Cands.empty(num, k, x.device)
    for kind, g in groups:
        _collect_group(x, lse, par, kind, g, out, tops, processed)
    return out


def _own_top(tops: RowTops, g: Group, lp, norm, tokens) -> None:
    """The top logprobs of the group's rows whose request asks for its own, those rows only:
    the best of lp - norm (lp [r, m] over what each row allows, `tokens` its token ids)."""
    own = tops.own_rows(g.beams, g.num_rows)
    if own is None:
        return
    pos, k = own
    sel = torch.from_numpy(pos).to(lp.device)
    if torch.is_tensor(norm):
        norm = norm.index_select(0, sel)
    values, cols = lp.index_select(0, sel).topk(min(k, lp.shape[1]), dim=-1)
    values = torch.nan_to_num(values - norm, nan=NEG_INF, neginf=NEG_INF)
    ids = cols if tokens is None else tokens.index_select(0, sel).gather(1, cols)
    tops.put_top(g.rows[pos], values, ids)


def _collect_group(
    x, lse, par: Parents, kind: str, g: Group, out: Cands, tops: RowTops, processed: bool
) -> None:
    dev = x.device
    rows = torch.from_numpy(g.rows).to(dev)
    trie = g.beams[0].trie
    if trie is None:
        # logits [r, vocab], their log-probabilities xr - row_lse: never made whole (ranking
        # and sampling are shift-invariant per row), and the step's own buffer when the group
        # is every row in order (the usual step)
        whole = g.rows.size == x.shape[0] and bool((g.rows == np.arange(x.shape[0])).all())
        xr = x if whole else x.index_select(0, rows)
        row_lse = (lse if whole else lse.index_select(0, rows))[:, None]
        tokens = nodes = ends = None
    else:
        xr, tokens, nodes, ends = _children(x, lse, par, rows, g, trie)  # log-probabilities
        row_lse = 0.0
    p_score, p_key, p_phi = par.score[rows], par.key[rows], par.phi[rows]
    width = max(b.width for b in g.beams)
    m = xr.shape[1]
    if kind == "det":
        kk = min(max(b.num_candidates for b in g.beams), m)
        lp, col = row_top(xr, row_lse, p_score, g.num_rows, kk)  # wide beams: far fewer
        score = p_score[:, None] + (lp - row_lse)
        key = score
        # the behaviour distribution: the processed log-probabilities renormalised
        norm = sampler.row_logsumexp(xr, True) if tokens is not None or processed else row_lse
        blp = torch.nan_to_num(lp - norm, nan=NEG_INF, neginf=NEG_INF)
        _own_top(tops, g, xr, norm, tokens)
    else:
        lpt = _sampling(xr, g, dev)
        u = _noise(kind, g, m, dev)
        if kind == "sample":
            col = sampler.draw_one(lpt, u)[:, None]
            ok = torch.isfinite(lpt.gather(1, col))
            key = torch.where(ok, p_key[:, None], NEG_INF)
        else:
            # w + 1 per row: the step's (w + 1)-th largest key is among them
            gum = sampler.gumbel(p_phi[:, None] + lpt, u)
            top, col = gum.topk(min(width + 1, m), dim=-1)
            key = sampler.conditioned(top, gum.max(-1).values, p_key)
        score = p_score[:, None] + (xr.gather(1, col) - row_lse)
        blp = lpt.gather(1, col)
        _own_top(tops, g, lpt, 0.0, tokens)
        tops.put_mask(g.beams, g.num_rows, g.rows, lpt, tokens)
    phi = p_phi[:, None] + blp
    tok = col if tokens is None else tokens.gather(1, col)
    node = torch.zeros_like(col) if nodes is None else nodes.gather(1, col)
    end = torch.zeros_like(col, dtype=torch.bool) if ends is None else ends.gather(1, col)
    parent_row = rows[:, None].expand_as(col)
    # per request, the best of its rows' candidates
    w = col.shape[1]
    kk = out.key.shape[1]
    lengths = np.array(g.num_rows) * w
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    top, pos = segment_topk(key.flatten(), starts, lengths, kk)
    # a request with fewer candidates than kk (a narrow trie level, its prefill row) gets
    # padding: a dead candidate of its own first row (its parent must be one of its own beams,
    # never a row of the request batched after it), token and node 0, -inf everywhere
    pad = pos >= key.numel()
    pos = torch.where(pad, torch.from_numpy(starts).to(dev)[:, None], pos)
    limit = torch.tensor([b.num_candidates for b in g.beams], device=dev)
    top = top.masked_fill(torch.arange(kk, device=dev)[None] >= limit[:, None], NEG_INF)
    reqs = torch.tensor(g.reqs, device=dev)
    out.key[reqs] = top
    for name, t, fill in (
        ("score", score, NEG_INF),
        ("phi", phi, NEG_INF),
        ("token", tok, 0),
        ("node", node, 0),
        ("row", parent_row, None),
        ("item_end", end, False),
        ("blp", blp, NEG_INF),
    ):
        got = t.flatten()[pos]
        getattr(out, name)[reqs] = got if fill is None else got.masked_fill(pad, fill)


def _children(x, lse, par: Parents, rows, g: Group, trie):
    """A catalog group's rows: log-probabilities of each row's trie children [r, width] (-inf
    where none or masked), their tokens, child nodes and whether each completes an item."""
    dev = x.device
    width = max(trie.width(b.trie_depth) for b in g.beams)
    tokens, children, valid = trie.children(par.node[rows], width)
    xr = x[rows[:, None], tokens] - lse[rows][:, None]
    ends = trie.is_terminal[children] & valid
    mask = ~valid
    banned = [(i, b.banned) for i, b in enumerate(g.beams) if b.banned is not None]
    if banned:
        local = torch.from_numpy(np.repeat(np.arange(len(g.beams)), g.num_rows)).to(dev)
        num_nodes = trie.num_nodes
        keys = torch.cat([i * num_nodes + nodes for i, nodes in banned])
        mask |= torch.isin(local[:, None] * num_nodes + children, keys)
    # before min_new_tokens: the children whose every item ends too soon (min_length.py)
    need = [b.start_depth + b.params.min_new_tokens for b in g.beams]
    if any(b.num_steps + 1 < b.params.min_new_tokens for b in g.beams):
        depth = torch.from_numpy(np.repeat(np.array(need, np.int32), g.num_rows)).to(dev)
        mask |= min_length.deepest(trie)[children] < depth[:, None]
    # a padded entry repeats the next node's children: it leads nowhere (node 0)
    return xr.masked_fill(mask, NEG_INF), tokens, children.masked_fill(~valid, 0), ends


def _noise(kind: str, g: Group, m: int, dev) -> torch.Tensor:
    """Each request's uniforms from its own generator, shaped by the request alone (one per
    row to sample, one per row and allowed token for Gumbel keys), so that what it draws does
    not depend on what it is batched with: [rows] or [rows, m]."""
    gens = [b.generator for b in g.beams]
    if kind == "sample":
        return torch.cat(sampler.uniforms(gens, [(n,) for n in g.num_rows], dev))
    own = [m if b.trie is None else b.trie.width(b.trie_depth) for b in g.beams]
    parts = sampler.uniforms(gens, [(n, w) for n, w in zip(g.num_rows, own, strict=True)], dev)
    u = torch.full((sum(g.num_rows), m), 0.5, device=dev)
    start = 0
    for part in parts:
        u[start : start + part.shape[0], : part.shape[1]] = part
        start += part.shape[0]
    return u


def _sampling(xr, g: Group, dev):
    """The group's rows' sampling log-probabilities (temperature and filters per request)."""
    m = xr.shape[1]
    ps = [b.params for b in g.beams]
    rep = np.array(g.num_rows)

    def per_row(values, dtype):
        return torch.from_numpy(np.repeat(np.array(values, dtype), rep)).to(dev)

    top_k = [p.top_k if 0 < p.top_k < m else m for p in ps]
    filters = (
        any(p.min_p > 0 for p in ps),
        max((k for k in top_k if k < m), default=0),
        any(p.top_p < 1 for p in ps),
    )
    return sampler.sampling_logprobs(
        xr,
        per_row([p.temperature for p in ps], np.float32),
        per_row(top_k, np.int64),
        per_row([p.top_p for p in ps], np.float32),
        per_row([p.min_p for p in ps], np.float32),
        filters,
    )
