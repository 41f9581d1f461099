"""What a step reports per row of its logits, beside the candidates: the best behaviour
log-probabilities of the row (top logprobs) and the row's sampling support (the tokens of
nonzero probability under the distribution a sampled row draws from, best first), each as
[rows, k] values and token ids, -inf (token 0) past what the row allows. Kept per row, not per
candidate: a beam's token reads its parent's row when the results are walked back.

Both tables hold the rows of the requests that ask only, and the support's is no wider than
the vocabulary (a support can hold no more tokens than there are): a step of a thousand rows
where one request of eight asks builds an [8, min(vocab, cap + 1)] table. Each asking request
keeps its own rows of the support (`own_mask`, a copy: the step's table is not held by anyone's
history), so what it holds is what its reply reads and what --max-kv-bytes counts for it
(kv_cache.sampling_mask_bytes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NEG_INF = float("-inf")


@dataclass
class RowTops:
    """Per row of the step, when asked: the best log-probabilities ([rows, k] values and token
    ids) and the sampling support ([rows, c]), each of the rows of the requests that ask only
    (request i's from firsts[i] / mask_firsts[i], -1: none; at[r] / mask_at[r] the table's row
    of the step's row r, -1: none)."""

    top: tuple[torch.Tensor, torch.Tensor] | None
    mask: tuple[torch.Tensor, torch.Tensor] | None
    firsts: list[int] | None = None
    at: np.ndarray | None = None
    mask_firsts: list[int] | None = None
    mask_at: np.ndarray | None = None

    @classmethod
    def empty(cls, blocks: list, rows: int, vocab: int, device) -> RowTops:
        """blocks: the step's (beams, first_row, num_rows), in order; vocab: the logits' width."""

        def pair(num, width):
            if width == 0 or num == 0:
                return None
            return (
                torch.full((num, width), NEG_INF, device=device),
                torch.zeros((num, width), dtype=torch.int64, device=device),
            )

        def index(asks):
            at, firsts, num = np.full(rows, -1, np.int64), [], 0
            for b in blocks:
                firsts.append(num if asks(b.beams) else -1)
                if asks(b.beams):
                    at[b.first_row : b.first_row + b.num_rows] = np.arange(num, num + b.num_rows)
                    num += b.num_rows
            return at, firsts, num

        k = max((b.beams.top_logprobs for b in blocks), default=0)
        c = min(max((b.beams.mask_width for b in blocks), default=0), vocab)
        out = cls(None, None)
        if k > 0:
            out.at, out.firsts, num = index(lambda beams: beams.top_logprobs > 0)
            out.top = pair(num, k)
        if c > 0:
            out.mask_at, out.mask_firsts, num = index(lambda beams: beams.mask_width > 0)
            out.mask = pair(num, c)
        return out

    def own_rows(self, beams: list, num_rows: list[int]) -> tuple[np.ndarray, int] | None:
        """Of a group's rows (its requests' rows in order), the positions of those whose request
        reports its own (behaviour) top logprobs, and the largest k they ask; None: none does."""
        if self.top is None:
            return None
        own = [b.top_logprobs > 0 and not b.original_logprob for b in beams]
        if not any(own):
            return None
        k = max(b.top_logprobs for b, o in zip(beams, own, strict=True) if o)
        return np.flatnonzero(np.repeat(own, num_rows)), k

    def put_mask(self, beams: list, num_rows: list[int], rows: np.ndarray, lpt, tokens) -> None:
        """Write the support of a sampled group's rows whose request asks (rows: the group's
        step rows, lpt [r, m] their sampling log-probabilities, `tokens` their token ids)."""
        if self.mask is None:
            return
        asks = np.repeat([b.mask_width > 0 for b in beams], num_rows)
        if not asks.any():
            return
        pos = torch.from_numpy(np.flatnonzero(asks)).to(lpt.device)
        values, cols = lpt.index_select(0, pos).topk(min(self.mask[0].shape[1], lpt.shape[1]))
        ids = cols if tokens is None else tokens.index_select(0, pos).gather(1, cols)
        index = torch.from_numpy(self.mask_at[rows[asks]]).to(lpt.device)
        c = values.shape[1]
        self.mask[0][index, :c] = values
        self.mask[1][index, :c] = ids

    def own_mask(self, i: int, beams) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Request i's rows of the support (beams: its Beams), copied: what its history keeps;
        no wider than its own cap."""
        if self.mask is None or beams.mask_width == 0 or self.mask_firsts[i] < 0:
            return None
        first, c = self.mask_firsts[i], min(beams.mask_width, self.mask[0].shape[1])
        rows = slice(first, first + beams.num_rows)
        return self.mask[0][rows, :c].clone(), self.mask[1][rows, :c].clone()

    def put_top(self, rows: np.ndarray, values, ids) -> None:
        """Write the step's rows' best (value, token id) pairs into the top table."""
        index = torch.from_numpy(self.at[rows]).to(values.device)
        c = values.shape[1]
        self.top[0][index, :c] = values
        self.top[1][index, :c] = ids
