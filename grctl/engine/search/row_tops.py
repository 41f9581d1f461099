"""What a step reports per row of its logits, beside the candidates: the best behaviour
log-probabilities of the row (top logprobs) and the row's sampling support (the tokens of
nonzero probability under the distribution a sampled row draws from, best first), each as
[rows, k] values and token ids, -inf (token 0) past what the row allows. Kept per row, not per
candidate: a beam's token reads its parent's row when the results are walked back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NEG_INF = float("-inf")


@dataclass
class RowTops:
    """Per row of the step, when asked: the best log-probabilities ([rows, k] values and token
    ids) of the rows of the requests that ask only (request i's from firsts[i], -1: none; at[r]
    the table's row of the step's row r, -1: none), and the sampling support ([rows, c], every
    row of the step)."""

    top: tuple[torch.Tensor, torch.Tensor] | None
    mask: tuple[torch.Tensor, torch.Tensor] | None
    firsts: list[int] | None = None
    at: np.ndarray | None = None

    @classmethod
    def empty(cls, blocks: list, rows: int, c: int, device) -> RowTops:
        """blocks: the step's (beams, first_row, num_rows), in order."""

        def pair(num, width):
            if width == 0 or num == 0:
                return None
            return (
                torch.full((num, width), NEG_INF, device=device),
                torch.zeros((num, width), dtype=torch.int64, device=device),
            )

        k = max((b.beams.top_logprobs for b in blocks), default=0)
        at, firsts, num = np.full(rows, -1, np.int64), [], 0
        for b in blocks:
            firsts.append(num if b.beams.top_logprobs > 0 else -1)
            if b.beams.top_logprobs > 0:
                at[b.first_row : b.first_row + b.num_rows] = np.arange(num, num + b.num_rows)
                num += b.num_rows
        if k == 0 or num == 0:
            return cls(None, pair(rows, c))
        return cls(pair(num, k), pair(rows, c), firsts, at)

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

    def put_top(self, rows: np.ndarray, values, ids) -> None:
        """Write the step's rows' best (value, token id) pairs into the top table."""
        index = torch.from_numpy(self.at[rows]).to(values.device)
        c = values.shape[1]
        self.top[0][index, :c] = values
        self.top[1][index, :c] = ids

    @staticmethod
    def put(pair, rows, values, cols, tokens) -> None:
        """Write rows' best (value, column) pairs into one table, columns read as token ids
        through `tokens` (a catalog row's children; None: columns are token ids)."""
        ids = cols if tokens is None else tokens.gather(1, cols)
        c = values.shape[1]
        pair[0][rows, :c] = values
        pair[1][rows, :c] = ids
