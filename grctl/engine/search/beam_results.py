"""A finished (or aborted) search's returned beams, read once on the host from its step states.

Each returned beam walks its parents back through the request's history: its tokens, their
reported log-probabilities, and when asked the top log-probabilities and the sampling support
of each token. A stochastic search (width > 1) returns the num_return largest keys, each with
its draw order (its rank among them), and sets the request's Gumbel threshold: the
(num_return + 1)-th largest key of the whole search, which is the largest of the pool's other
keys and of every key a step dropped (beam.py); None when no finite one exists (every sequence
of the support was drawn) or the search was aborted.
"""

from __future__ import annotations

import torch

from grctl.engine.search.beam import LP, NEG_INF, REASONS, STOP, STOP_STRING, BeamResult, Beams


def walk(b: Beams, aborted: bool = False) -> list[BeamResult]:
    """The returned beams (num_return of them) best first; aborted: the running beams too, as
    they stand."""
    b.gumbel_threshold = None
    if b.num_steps == 0:
        return []
    s, i, w = b.state, b.row, b.width
    f, n = s.pool_f[i, :w], s.pool_i[i, :w]
    if aborted:
        run_i = s.run_i[i, :w]
        length = torch.full_like(run_i[:, :1], b.num_steps)
        f = torch.cat((f, s.run_f[i, :w]))
        n = torch.cat((n, torch.cat((run_i, length, torch.full_like(length, -1)), 1)))
    hist_i = torch.stack([st.run_i[r, :w] for st, r in b.history]).tolist()  # [T, w, 3]
    hist_lp = torch.stack([st.run_f[r, :w, LP] for st, r in b.history]).tolist()
    tops = _RowReader(b, "rows_top", b.top_logprobs) if b.top_logprobs > 0 else None
    masks = _RowReader(b, "mask", b.mask_width) if b.mask_width > 0 else None
    beams = []
    for j, (score, key, phi, lp) in enumerate(f.tolist()):
        node, token, parent, length, reason = n[j].tolist()
        if key == NEG_INF:
            continue
        ids, lps, rows = [token], [lp], [(length - 1, parent)]  # (step, parent slot) per token
        for t in range(length - 2, -1, -1):
            ids.append(hist_i[t][parent][1])
            lps.append(hist_lp[t][parent])
            parent = hist_i[t][parent][2]
            rows.append((t, parent))
        for seq in (ids, lps, rows):
            seq.reverse()
        finish = REASONS.get(reason, "abort")
        matched = b.stop_string if reason == STOP_STRING else None
        if reason == STOP:
            matched = ids[-1]
        top = [tops.pairs(t, p) for t, p in rows] if tops is not None else None
        beam = BeamResult(ids, score, finish, lps, top, node, matched, phi)
        if b.is_gumbel:
            beam.gumbel_key = key
        if b.wants_mask:
            _set_mask(beam, [masks.pairs(t, p) for t, p in rows] if masks else None, b.mask_width)
        beams.append((key, beam))
    beams.sort(key=lambda kb: kb[0], reverse=True)
    chosen = [beam for _, beam in beams[: b.num_return]]
    if b.is_gumbel:
        for order, beam in enumerate(chosen):
            beam.draw_order = order
        if not aborted:
            b.gumbel_threshold = _threshold(b, [k for k, _ in beams])
    if b.is_stochastic:  # a sample: shown best score first
        chosen.sort(key=lambda beam: beam.sequence_score, reverse=True)
    return chosen


class _RowReader:
    """One per-row table of every step (StepState.rows_top, or the request's own
    Beams.mask_history), this request's rows read to the host once per step, on first use."""

    def __init__(self, b: Beams, name: str, k: int):
        self.b, self.name, self.k = b, name, k
        self.steps: dict[int, tuple[list, list]] = {}

    def pairs(self, t: int, slot: int) -> list[tuple[float, int]]:
        """(log-probability, token) of step t's row `slot`, best first, those of -inf left out."""
        if t not in self.steps:
            num = 1 if t == 0 else self.b.width
            if self.name == "mask":
                first, (values, ids) = 0, self.b.mask_history[t]
            else:
                st, r = self.b.history[t]
                firsts = st.top_first_rows
                first = (firsts if firsts is not None else st.first_rows)[r]
                values, ids = st.rows_top
            self.steps[t] = (
                values[first : first + num, : self.k].tolist(),
                ids[first : first + num, : self.k].tolist(),
            )
        values, ids = self.steps[t]
        return [(v, tok) for v, tok in zip(values[slot], ids[slot], strict=True) if v > NEG_INF]


def _threshold(b: Beams, keys: list[float]) -> float | None:
    """The (num_return + 1)-th largest key of the search: of the pool's keys (best first) and
    the largest key any step dropped."""
    dropped = torch.stack([st.dropped[r] for st, r in b.history if st.dropped is not None])
    keys = sorted([*keys, dropped.max().item()], reverse=True)
    k = b.num_return
    return keys[k] if len(keys) > k and keys[k] > NEG_INF else None


def _set_mask(beam: BeamResult, masks, width: int) -> None:
    """Each token's support and its log-probabilities; at T = 0 the chosen token alone, with
    log-probability 0 (SGLang's greedy mask). A support of `width` tokens is over the cap."""
    if masks is None:
        beam.sampling_mask = [[t] for t in beam.output_ids]
        beam.sampling_mask_logprobs = [[0.0] for _ in beam.output_ids]
        return
    if any(len(m) >= width for m in masks):
        beam.mask_overflow = True
        return
    beam.sampling_mask = [[t for _, t in m] for m in masks]
    beam.sampling_mask_logprobs = [[v for v, _ in m] for m in masks]
