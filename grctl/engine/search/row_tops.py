"""What a step reports per row of its logits, beside the candidates: the best behaviour
log-probabilities of the row (top logprobs) and the row's sampling support (the tokens of
nonzero probability under the distribution a sampled row draws from, best first), each as
[rows, k] values and token ids, -inf (token 0) past what the row allows. Kept per row, not per
candidate: a beam's token reads its parent's row when the results are walked back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class RowTops:
    """Per row of the step, when asked: the best behaviour log-probabilities ([rows, k] values
    and token ids) and the sampling support ([rows, c])."""

    top: tuple[torch.Tensor, torch.Tensor] | None
    mask: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def empty(cls, rows: int, k: int, c: int, device) -> RowTops:
        def pair(width):
            if width == 0:
                return None
            return (
                torch.full((rows, width), NEG_INF, device=device),
                torch.zeros((rows, width), dtype=torch.int64, device=device),
            )

        return cls(pair(k), pair(c))

    def wants_top(self, beams: list) -> bool:
        """Some request of the group reports its own (behaviour) top logprobs."""
        return self.top is not None and any(
            b.top_logprobs > 0 and not b.original_logprob for b in beams
        )

    @staticmethod
    def put(pair, rows, values, cols, tokens) -> None:
        """Write rows' best (value, column) pairs into one table, columns read as token ids
        through `tokens` (a catalog row's children; None: columns are token ids)."""
        ids = cols if tokens is None else tokens.gather(1, cols)
        c = values.shape[1]
        pair[0][rows, :c] = values
        pair[1][rows, :c] = ids
