"""One search step for every request of a batch together, from the step's logits [rows, vocab].

All requests advance in one set of batched ops: the log-sum-exp of every row (a log-probability
is logit - lse; no [rows, vocab] log-softmax is kept), the request's processors and min_new_tokens
as one set of edits, each request's K best candidates (candidates.py: per-row top-k, draws or
Gumbel keys, then a segmented top-k), which of them end a sequence, and the new running beams
and pools of all requests, padded to [requests, width]. The only device-to-host copy is the
last: every request's "search is over" flag.

The log-probability reported for a token (return_logprob) is by default the behaviour policy's:
of the distribution the token was drawn from or searched over (candidates.py), after the
processors, the catalog mask, the exclusions, min_new_tokens, the temperature and the filters,
renormalised; with original_logprob the model's own log_softmax(logits), before all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grctl.engine.search import candidates
from grctl.engine.search.beam import (
    ITEM,
    KEY,
    LENGTH,
    NEG_INF,
    NODE,
    SCORE,
    STOP,
    Beams,
    StepState,
)
from grctl.engine.search.candidates import Cands, Group, Parents
from grctl.engine.search.logits_processors import apply_edits
from grctl.engine.search.row_tops import RowTops
from grctl.engine.search.sampler import row_logsumexp


@dataclass
class Block:
    """One request's rows of the step's logits: rows first_row .. first_row + num_rows."""

    beams: Beams
    first_row: int
    num_rows: int


def step(logits: torch.Tensor, blocks: list[Block]) -> None:
    """Advance every block's beams by one token; each Beams holds its new state after."""
    dev = logits.device
    logits = logits.float()
    lse = row_logsumexp(logits)  # [rows]
    par = _parents(blocks, logits.shape[0], dev)
    x = _processed(logits, lse, blocks)
    num_cands = max(b.beams.num_candidates for b in blocks)
    tops = RowTops.empty(blocks, logits.shape[0], logits.shape[1], dev)
    groups = _groups(blocks)
    cands = candidates.collect(x, lse, par, groups, len(blocks), num_cands, tops, x is not logits)
    lp = _reported(logits, lse, cands, blocks, tops)
    reasons = _reasons(cands, blocks, logits.shape[1])
    _update(blocks, cands, lp, reasons, tops)


def _tensor(values: list, dtype, dev) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype)).to(dev)


def _parents(blocks: list[Block], num_rows: int, dev) -> Parents:
    """The running beam each row extends, gathered from each request's last state (a prefill
    row extends the empty prefix: score and phi 0, key 0 or a stochastic search's root key, at
    the trie node its item resumes at)."""
    f = torch.zeros((num_rows, 3), device=dev)
    node = torch.zeros(num_rows, dtype=torch.int64, device=dev)
    resumed = [(b.first_row, b.beams.start_node) for b in blocks if not b.beams.is_started]
    if any(n for _, n in resumed):
        rows, nodes = zip(*resumed, strict=True)
        node[_tensor(rows, np.int64, dev)] = _tensor(nodes, np.int64, dev)
    roots = [b for b in blocks if not b.beams.is_started and b.beams.root_key is not None]
    if roots:
        rows = torch.tensor([b.first_row for b in roots], device=dev)
        f[rows, 1] = torch.cat([b.beams.root_key for b in roots])
    for state, items in _by_state(blocks).items():
        n = state.run_f.shape[1]
        src = np.concatenate([j * n + np.arange(b.num_rows) for b, j in items])
        dst = np.concatenate([b.first_row + np.arange(b.num_rows) for b, _ in items])
        src_t, dst_t = torch.from_numpy(src).to(dev), torch.from_numpy(dst).to(dev)
        f[dst_t] = state.run_f.view(-1, state.run_f.shape[2])[src_t, :3]
        node[dst_t] = state.run_i.view(-1, state.run_i.shape[2])[src_t, NODE]
    return Parents(f[:, 0], f[:, 1], f[:, 2], node)


def _by_state(blocks: list[Block]) -> dict[StepState, list[tuple[Block, int]]]:
    out: dict = {}
    for b in blocks:
        if b.beams.is_started:
            out.setdefault(b.beams.state, []).append((b, b.beams.row))
    return out


def _processed(logits, lse, blocks: list[Block]) -> torch.Tensor:
    """The logits after each request's processors (and, before min_new_tokens, with its stop
    tokens at -inf); the runner's buffer, or a cached prefill row, stays intact."""
    edits = []
    for b in blocks:
        beams = b.beams
        phase = "decode" if beams.is_started else "prefill"
        table = beams.edits_short if beams.num_steps < beams.params.min_new_tokens else beams.edits
        if len(table[phase]):
            edits.append((b.first_row, b.num_rows, table[phase]))
    if not edits:
        return logits
    x = logits.clone()
    apply_edits(x, lse, edits)
    return x


def _groups(blocks: list[Block]) -> list[tuple[str, Group]]:
    """Requests that choose alike: by trie and by kind (det, sample, gumbel)."""
    groups: dict[tuple, tuple[str, Group]] = {}
    for i, b in enumerate(blocks):
        beams = b.beams
        kind = "det" if not beams.is_stochastic else "sample" if beams.width == 1 else "gumbel"
        key = (id(beams.trie) if beams.trie is not None else None, kind)
        if key not in groups:
            groups[key] = (kind, Group([], [], [], []))
        g = groups[key][1]
        g.reqs.append(i)
        g.beams.append(beams)
        g.firsts.append(b.first_row)
        g.num_rows.append(b.num_rows)
    return list(groups.values())


def _reported(logits, lse, cands: Cands, blocks: list[Block], tops: RowTops):
    """The reported log-probability of every candidate [R, K] (the behaviour's, or the model's
    log_softmax(logits) for a request with original_logprob); the model's top log-probabilities
    of the rows of an original_logprob request that asks for them go into `tops`."""
    dev = logits.device
    orig = [b.beams.original_logprob for b in blocks]
    lp = cands.blp
    if any(orig):
        raw = logits[cands.row, cands.token.clamp(min=0)] - lse[cands.row]
        lp = torch.where(_tensor(orig, bool, dev)[:, None], raw, lp)
    asking = [b for b in blocks if b.beams.original_logprob and b.beams.top_logprobs > 0]
    if asking:
        k = max(b.beams.top_logprobs for b in asking)
        rows = np.concatenate([np.arange(b.first_row, b.first_row + b.num_rows) for b in asking])
        sel = torch.from_numpy(rows).to(dev)
        values, ids = logits.index_select(0, sel).topk(min(k, logits.shape[1]), dim=-1)
        tops.put_top(rows, values - lse.index_select(0, sel)[:, None], ids)
    return lp


def _reasons(cands: Cands, blocks: list[Block], vocab: int) -> torch.Tensor:
    """Why each candidate ends its sequence, [R, K] int8 (0: it runs on); a stop token first,
    then a completed item, then the last allowed token."""
    dev = cands.key.device
    last = [b.beams.num_steps + 1 >= b.beams.max_new_tokens for b in blocks]
    reasons = torch.where(_tensor(last, bool, dev)[:, None], LENGTH, 0)
    reasons = torch.where(cands.item_end, ITEM, reasons)
    stops = [(i, b.beams.stop_ids) for i, b in enumerate(blocks) if b.beams.stop_ids]
    if stops:
        keys = np.concatenate([i * vocab + np.array(ids, np.int64) for i, ids in stops])
        req = torch.arange(len(blocks), device=dev)[:, None]
        is_stop = torch.isin(req * vocab + cands.token, torch.from_numpy(keys).to(dev))
        reasons = torch.where(is_stop, STOP, reasons)
    return reasons.to(torch.int8)


def _update(blocks: list[Block], c: Cands, lp, reasons, tops: RowTops) -> None:
    """Every request's new running beams and pool (beam.py's rules), in one set of ops."""
    dev = c.key.device
    num, k = c.key.shape
    beams = [b.beams for b in blocks]
    n = max(b.width for b in beams)
    width = _tensor([b.width for b in beams], np.int64, dev)
    stoch = _tensor([b.is_stochastic for b in beams], bool, dev)[:, None]
    gumbel = _tensor([b.is_gumbel for b in beams], bool, dev)
    steps = [b.num_steps for b in beams]
    length = _tensor([s + 1 for s in steps], np.float32, dev)
    penalty = _tensor([b.params.length_penalty for b in beams], np.float32, dev)
    first = _tensor([b.first_row for b in blocks], np.int64, dev)
    prev_f, prev_i = _previous_pools(blocks, n, dev)

    finite = c.key > NEG_INF
    ends = (reasons > 0) & finite
    runs = ~ends & finite
    rank = torch.arange(k, device=dev)[None]
    # deterministic: an ending candidate joins the pool if among the first w; the first w that
    # do not end run on. Stochastic: the w largest keys of pool and candidates are kept, and
    # the (w + 1)-th is the largest this step drops.
    ranked = torch.cat((prev_f[..., KEY], c.key), 1).topk(n + 1, dim=1).values
    in_top = c.key >= ranked.gather(1, (width - 1)[:, None])
    dropped = torch.where(gumbel, ranked.gather(1, width[:, None]).squeeze(1), NEG_INF)
    joins = torch.where(stoch, ends & in_top, ends & (rank < width[:, None]))
    runs = torch.where(stoch, runs & in_top, runs & (runs.cumsum(1) <= width[:, None]))
    normalized = c.score / length[:, None] ** penalty[:, None]
    pool_key = torch.where(joins, torch.where(stoch, c.key, normalized), NEG_INF)

    run_key, pick = torch.where(runs, c.key, NEG_INF).topk(n, dim=1)
    slot = c.row - first[:, None]
    run_f = torch.stack((c.score, c.key, c.phi, lp), 2).gather(1, _cols(pick, 4))
    run_f[..., KEY] = run_key
    # a dead beam (fewer valid candidates than beams) keeps no score: it must not revive
    run_f[..., SCORE] = run_f[..., SCORE].masked_fill(run_key == NEG_INF, NEG_INF)
    run_i = torch.stack((c.node, c.token, slot), 2).gather(1, _cols(pick, 3))

    lengths = length.to(torch.int64)[:, None].expand(num, k)
    cand_f = torch.stack((c.score, pool_key, c.phi, lp), 2)
    cand_i = torch.stack((c.node, c.token, slot, lengths, reasons.to(torch.int64)), 2)
    merged_f, merged_i = torch.cat((prev_f, cand_f), 1), torch.cat((prev_i, cand_i), 1)
    kept_key, keep = merged_f[..., KEY].topk(n, dim=1)
    kept_key = kept_key.masked_fill(torch.arange(n, device=dev)[None] >= width[:, None], NEG_INF)
    pool_f = merged_f.gather(1, _cols(keep, 4))
    pool_f[..., KEY] = kept_key
    pool_i = merged_i.gather(1, _cols(keep, 5))

    best = run_f[:, 0, SCORE].where(run_key[:, 0] > NEG_INF, NEG_INF)
    worst = kept_key.gather(1, (width - 1)[:, None]).squeeze(1)
    max_new = _tensor([b.max_new_tokens for b in beams], np.float32, dev)
    # the best normalised score a running beam could still reach, at some length to come
    bound = torch.maximum(best / length**penalty, best / max_new**penalty)
    bound = torch.where(penalty == 0, best, bound)
    det_over = (best == NEG_INF) | ((worst > NEG_INF) & (bound <= worst))
    over = torch.where(stoch[:, 0], run_key[:, 0] == NEG_INF, det_over)
    firsts = [b.first_row for b in blocks]
    state = StepState(run_f, run_i, pool_f, pool_i, dropped, firsts, tops.top, tops.firsts)
    masks = [tops.own_mask(i, b) for i, b in enumerate(beams)]  # before advance: its num_rows
    for i, (b, is_over) in enumerate(zip(beams, over.tolist(), strict=True)):
        b.advance(state, i, is_over, masks[i])


def _cols(index: torch.Tensor, num: int) -> torch.Tensor:
    return index[..., None].expand(*index.shape, num)


def _previous_pools(blocks: list[Block], n: int, dev):
    """Each request's pool before this step, padded to [R, n] (empty before the first step)."""
    num = len(blocks)
    f = torch.full((num, n, 4), NEG_INF, device=dev)
    i = torch.zeros((num, n, 5), dtype=torch.int64, device=dev)
    index = {id(b): r for r, b in enumerate(blocks)}
    for state, items in _by_state(blocks).items():
        reqs = torch.tensor([index[id(b)] for b, _ in items], device=dev)
        rows = torch.tensor([j for _, j in items], device=dev)
        c = min(n, state.pool_f.shape[1])
        f[reqs, :c] = state.pool_f[rows, :c]
        i[reqs, :c] = state.pool_i[rows, :c]
    return f, i
