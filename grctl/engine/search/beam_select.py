"""One search step for every request of a batch together, from the step's logits [rows, vocab].

Per row, only what the search can use is computed: the log-sum-exp (so a log-probability is
logit - lse, with no [rows, vocab] log-softmax kept) and the row's best K candidates: the top K
logits of a free row, or, for a row under a catalog, its trie node's children gathered in one
batched gather per catalog (width: the widest fan-out at that depth, known on the host). Then per
request the best K of its rows' K candidates (n * K of them; one padded topk for all requests),
which candidates end a sequence, and Beams.update. The only device-to-host copy is the last one:
every request's "search is over" flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grctl.engine.search.beam import ITEM, LENGTH, NEG_INF, STOP, Beams
from grctl.engine.search.logits_processors import LogitsRule, apply_rules


@dataclass
class Block:
    """One request's rows of the step's logits: rows first_row .. first_row + num_rows."""

    beams: Beams
    first_row: int
    num_rows: int
    rules: tuple[LogitsRule, ...] = ()


@dataclass
class _Cands:  # one block's per-row candidates [rows, W]
    logprobs: torch.Tensor  # log-probabilities (processors applied), -inf where none
    tokens: torch.Tensor
    nodes: torch.Tensor  # the trie node each candidate leads to (0 without a catalog)


def step(logits: torch.Tensor, blocks: list[Block]) -> list[torch.Tensor]:
    """Advance every block's beams by one token; returns each block's parents [n]."""
    lse = torch.logsumexp(logits.float(), dim=-1)  # [rows]
    if any(b.rules for b in blocks):
        logits = logits.clone()  # the runner's buffer (or a cached prefill row) stays intact
        for b in blocks:
            if b.rules:
                s = slice(b.first_row, b.first_row + b.num_rows)
                phase = "decode" if b.beams.is_started else "prefill"
                apply_rules(logits[s], lse[s], b.rules, phase)
    cands: dict[int, _Cands] = {}
    free = [i for i, b in enumerate(blocks) if b.beams.trie is None and b.beams.num_beams > 1]
    if free:
        _free_rows(logits, lse, [blocks[i] for i in free], free, cands)
    by_trie: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        if b.beams.trie is not None:
            by_trie.setdefault(id(b.beams.trie), []).append(i)
    for group in by_trie.values():
        _catalog_rows(logits, lse, [blocks[i] for i in group], group, cands)
    for i, b in enumerate(blocks):
        if b.beams.num_beams == 1:
            cands[i] = _sampled(b, cands.get(i), logits, lse)
    return _select(blocks, [cands[i] for i in range(len(blocks))])


def _free_rows(logits, lse, blocks: list[Block], ids: list[int], cands: dict) -> None:
    k = min(max(b.beams.num_candidates for b in blocks), logits.shape[1])
    whole = sum(b.num_rows for b in blocks) == logits.shape[0]  # the usual step: no catalog
    if whole:
        values, tokens = logits.topk(k, dim=-1)
        row_lse = lse
    else:
        idx = torch.cat([_arange(b, logits.device) for b in blocks])
        values, tokens = logits.index_select(0, idx).topk(k, dim=-1)
        row_lse = lse.index_select(0, idx)
    logprobs = values.float() - row_lse[:, None]
    start = 0
    for i, b in zip(ids, blocks, strict=True):
        first = b.first_row if whole else start
        s = slice(first, first + b.num_rows)
        start += b.num_rows
        cands[i] = _Cands(logprobs[s], tokens[s], torch.zeros_like(tokens[s]))


def _catalog_rows(logits, lse, blocks: list[Block], ids: list[int], cands: dict) -> None:
    trie = blocks[0].beams.trie
    width = max(trie.width(b.beams.num_steps) for b in blocks)
    nodes = torch.cat([b.beams.row_nodes() for b in blocks])
    tokens, children, valid = trie.children(nodes, width)  # [rows, width]
    rows = torch.cat([_arange(b, logits.device) for b in blocks])
    logprobs = logits[rows[:, None], tokens].float() - lse[rows][:, None]
    logprobs = logprobs.masked_fill(~valid, NEG_INF)
    # a padded entry repeats the next node's children: it leads nowhere (node 0), so that n == 1
    # matching the chosen token against the row finds the real child only
    children = children.masked_fill(~valid, 0)
    k = max(b.beams.num_candidates for b in blocks)
    if width > k and all(b.beams.num_beams > 1 for b in blocks):
        logprobs, pick = logprobs.topk(k, dim=-1)
        tokens, children = tokens.gather(1, pick), children.gather(1, pick)
    start = 0
    for i, b in zip(ids, blocks, strict=True):
        s = slice(start, start + b.num_rows)
        start += b.num_rows
        cands[i] = _Cands(logprobs[s], tokens[s], children[s])


def _sampled(b: Block, allowed: _Cands | None, logits, lse) -> _Cands:
    """n == 1: the Sampler picks one token from the (catalog-masked) distribution."""
    row = logits[b.first_row].float() - lse[b.first_row]  # [vocab]
    if allowed is not None:
        masked = torch.full_like(row, NEG_INF)
        masked.scatter_reduce_(0, allowed.tokens[0], allowed.logprobs[0], reduce="amax")
        row = masked
    token = b.beams.sampler.choose(row)  # [1]
    node = torch.zeros_like(token)
    if allowed is not None:
        hit = allowed.tokens[0] == token
        node = torch.where(hit, allowed.nodes[0], 0).max().view(1)
    return _Cands(row[token].view(1, 1), token.view(1, 1), node.view(1, 1))


def _arange(b: Block, device) -> torch.Tensor:
    return torch.arange(b.first_row, b.first_row + b.num_rows, device=device)


def _select(blocks: list[Block], cands: list[_Cands]) -> list[torch.Tensor]:
    device = cands[0].logprobs.device
    flat_len = max(c.logprobs.numel() for c in cands)
    keeps = [
        min(b.beams.num_candidates, c.logprobs.numel()) for b, c in zip(blocks, cands, strict=True)
    ]
    num_keep = max(keeps)
    scores = torch.full((len(blocks), flat_len), NEG_INF, device=device)
    for i, (b, c) in enumerate(zip(blocks, cands, strict=True)):
        total = c.logprobs + b.beams.row_scores()[:, None]  # [rows, W]
        scores[i, : total.numel()] = total.flatten()
    top, pos = scores.topk(num_keep, dim=-1)  # [requests, K] for all requests at once
    parents, overs = [], []
    for i, (b, c) in enumerate(zip(blocks, cands, strict=True)):
        beams = b.beams
        k = min(beams.num_candidates, c.logprobs.numel())
        width = c.logprobs.shape[1]
        p = pos[i, :k].clamp(max=c.logprobs.numel() - 1)  # past the end: -inf padding
        parent, col = p // width, p % width
        tokens, nodes = c.tokens[parent, col], c.nodes[parent, col]
        reasons = torch.zeros_like(tokens, dtype=torch.int8)
        if beams.num_steps + 1 >= beams.max_new_tokens:
            reasons.fill_(LENGTH)
        if beams.trie is not None:
            reasons = torch.where(beams.trie.is_terminal[nodes], ITEM, reasons).to(torch.int8)
        if beams.stop_ids:
            is_stop = torch.isin(tokens, beams.stop_tensor)
            reasons = torch.where(is_stop, STOP, reasons).to(torch.int8)
        beam_parents, over = beams.update(
            top[i, :k], c.logprobs[parent, col], parent, tokens, nodes, reasons
        )
        parents.append(beam_parents)
        overs.append(over)
    for b, over in zip(blocks, torch.stack(overs).tolist(), strict=True):
        b.beams.is_done = bool(over)
    return parents
