"""Catalog replay: the behaviour policy's log-probabilities from the trainer's own logits.

grctl reports, for every generated token, its log-probability under the distribution it was
actually drawn from (docs/http-api.md): the logits over T (T = 1 at temperature 0), restricted to
the catalog trie's children of the beam's prefix (less the nodes a request's exclude_item_ids
close, and before min_new_tokens the prefixes whose every item ends too soon), log-softmaxed, then
top_k / top_p / min_p judged on that distribution, the dropped tokens -inf and the rest
renormalised. A trainer needs the same quantity as a differentiable function of its own logits:

    log pi(y_t | x, y_<t) = z_t[y_t] - logsumexp_{v in K_t} z_t[v],   z_t = logits_t / T,

K_t the kept set (catalog children, exclusions, filters; before min_new_tokens, less the tokens
that end a sequence: the stop ids, the model's EOS unless ignore_eos, which Filters.of is told).
A resumed partial item (the prompt ends in one: item_prefix_len, or the catalog's own rule,
catalog/resume.py) starts at its node, as the server's search does.
`CatalogReplay.logprobs` computes it for a batch, gathering each position's allowed tokens (at
most the trie's widest fan-out) from the logits, so a 151k vocabulary costs no [batch, steps,
vocab] mask. The kept set is chosen without gradient (as the sampler chose it); the gradient
flows through the renormalisation.
Prompt tokens get the model's plain log_softmax (no temperature, no mask): what prompt scoring
reports. Request-level logits processors (biases) are not replayed: add them to the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from grctl.catalog import min_length
from grctl.catalog.exclusions import excluded_nodes
from grctl.catalog.loader import parse_catalog
from grctl.catalog.resume import ROOT, ItemStart, item_start
from grctl.catalog.store import Catalog, build_catalog
from grctl.catalog.trie import Trie
from grctl.errors import ValidationError

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Filters:
    """What a request's sampling_params say about its distribution (SGLang's names)."""

    temperature: float = 1.0  # 0 (deterministic beams): T = 1 and no top_k / top_p / min_p
    top_k: int = -1  # -1 or >= the allowed set: off
    top_p: float = 1.0
    min_p: float = 0.0
    min_new_tokens: int = 0
    exclude_item_ids: tuple[int | str, ...] = ()
    # the tokens that end a sequence (masked before min_new_tokens): the request's
    # stop_token_ids and the model's EOS ids, none with ignore_eos
    stop_token_ids: tuple[int, ...] = ()
    # the prompt's last k tokens begin the item (None: the catalog's rule, as the server's)
    item_prefix_len: int | None = None

    @classmethod
    def of(cls, sampling_params: dict, eos_token_ids: Sequence[int] = ()) -> Filters:
        """From a /generate body's sampling_params, as the server reads them: missing keys
        take its defaults (temperature 0: deterministic beams), and grctl's fields may also
        sit in `custom_params` (the form a router that drops unknown fields passes on).
        eos_token_ids: the served model's (its config's eos_token_id), which end a sequence
        unless ignore_eos."""
        sp = {**(sampling_params.get("custom_params") or {}), **sampling_params}
        stops = () if sp.get("ignore_eos") else (*eos_token_ids, *(sp.get("stop_token_ids") or ()))
        pinned = sp.get("item_prefix_len")
        return cls(
            temperature=float(sp.get("temperature") or 0.0),
            top_k=int(sp.get("top_k", -1)),
            top_p=float(sp.get("top_p", 1.0)),
            min_p=float(sp.get("min_p", 0.0)),
            min_new_tokens=int(sp.get("min_new_tokens", 0)),
            exclude_item_ids=tuple(sp.get("exclude_item_ids") or ()),
            stop_token_ids=tuple(dict.fromkeys(int(t) for t in stops)),
            item_prefix_len=None if pinned is None else int(pinned),
        )

    @property
    def tau(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Replayed:
    """output [B, T]: each generated token's behaviour log-probability (0 past its end);
    output_mask [B, T]; prompt [B, P - 1]: log p(prompt token j + 1 | tokens <= j), the plain
    log_softmax (0 past a prompt's end); prompt_mask [B, P - 1]."""

    output: torch.Tensor
    output_mask: torch.Tensor
    prompt: torch.Tensor
    prompt_mask: torch.Tensor

    def sequence(self) -> torch.Tensor:
        """[B]: each output's log-probability, the sum over its tokens (log q(y | x))."""
        return self.output.sum(-1)


class CatalogReplay:
    """The served catalog (or none: the whole vocabulary) on the trainer's side."""

    def __init__(self, catalog: Catalog | None):
        self.catalog = catalog
        self._banned: dict[tuple, np.ndarray] = {}

    @classmethod
    def load(cls, path: str, vocab_size: int | None = None) -> CatalogReplay:
        """Read the catalog file the server loads (`grctl serve --catalog PATH`)."""
        return cls(build_catalog(str(path), 0, torch.device("cpu"), vocab_size=vocab_size))

    @classmethod
    def parse(cls, data: bytes, vocab_size: int | None = None) -> CatalogReplay:
        """The same from the file's bytes (JSON lines)."""
        rows = parse_catalog(data, vocab_size=vocab_size)
        trie = Trie(rows.paths, rows.lengths, torch.device("cpu"))
        return cls(Catalog(0, trie, rows.ids, "<bytes>", 0.0, rows.file_bytes))

    def _banned_nodes(self, ids: tuple, min_depth: int) -> np.ndarray:
        key = (tuple(sorted(map(str, ids))), min_depth)
        if key not in self._banned:
            self._banned[key] = excluded_nodes(self.catalog, tuple(ids), min_depth)
        return self._banned[key]

    def starts(
        self, prompts: Sequence[Sequence[int]] | None, filters: Sequence[Filters]
    ) -> list[ItemStart]:
        """Where each output's item starts: the root, or inside the partial item its prompt
        ends with (item_prefix_len, or the catalog's own rule), as the server decides."""
        if prompts is None:
            return [ROOT] * len(filters)
        trie = self.catalog.trie
        pairs = zip(prompts, filters, strict=True)
        return [item_start(trie, p, f.item_prefix_len) for p, f in pairs]

    def supports(
        self,
        outputs: Sequence[Sequence[int]],
        filters: Sequence[Filters],
        prompts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each output position's allowed tokens before the filters: tokens [B, T, W] and valid
        [B, T, W] (W: the widest fan-out met), and the chosen token's column [B, T]; with the
        prompts, a resumed partial item continues from its node. Raises ValidationError for a
        token the catalog (or an exclusion) did not allow there."""
        trie = self.catalog.trie
        b, steps = len(outputs), max((len(o) for o in outputs), default=0)
        start = self.starts(prompts, filters)
        depth0 = [s.depth for s in start]
        widths = [max((trie.width(d + t) for d in set(depth0)), default=1) for t in range(steps)]
        width = max(widths, default=1)
        tokens = torch.zeros(b, steps, width, dtype=torch.int64)
        valid = torch.zeros(b, steps, width, dtype=torch.bool)
        col = torch.zeros(b, steps, dtype=torch.int64)
        valid[:, :, 0] = True  # padding: one finite entry, so no NaN reaches a gradient
        nodes = torch.tensor([s.node for s in start], dtype=torch.int64)
        alive = torch.ones(b, dtype=torch.bool)
        banned = [
            torch.from_numpy(self._banned_nodes(f.exclude_item_ids, d + f.min_new_tokens))
            if f.exclude_item_ids
            else None
            for f, d in zip(filters, depth0, strict=True)
        ]
        deepest = min_length.deepest(trie) if any(f.min_new_tokens for f in filters) else None
        for t in range(steps):
            here = torch.tensor([len(o) > t for o in outputs])
            if (here & ~alive).any():
                r = int(torch.nonzero(here & ~alive).flatten()[0])
                raise ValidationError(
                    f"output {r} runs on past the catalog item it completed at step {t - 1}",
                    hint="a beam ends at the first item it completes: cut the output there",
                )
            rows = torch.nonzero(here).flatten()
            tok, child, ok = trie.children(nodes[rows], widths[t])
            for j, r in enumerate(rows.tolist()):
                if banned[r] is not None:
                    ok[j] &= ~torch.isin(child[j], banned[r])
                f = filters[r]
                if t + 1 < f.min_new_tokens:  # prefixes whose items all end too soon
                    ok[j] &= deepest[child[j]] >= depth0[r] + f.min_new_tokens
                if t < f.min_new_tokens and f.stop_token_ids:  # no stop token yet
                    ok[j] &= ~torch.isin(tok[j], torch.tensor(f.stop_token_ids))
            chosen = torch.tensor([outputs[r][t] for r in rows.tolist()])
            hit = ok & (tok == chosen[:, None])
            missing = torch.nonzero(~hit.any(-1)).flatten()
            if missing.numel():
                r = int(rows[missing[0]])
                raise ValidationError(
                    f"output {r}'s token {outputs[r][t]} at step {t} is not allowed there by the "
                    "catalog (or its exclusions)",
                    hint="replay with the catalog file and the sampling_params the server used",
                )
            c = hit.int().argmax(-1)
            w = widths[t]
            tokens[rows, t, :w], valid[rows, t, :w], col[rows, t] = tok, ok, c
            nodes[rows] = child.gather(1, c[:, None])[:, 0]
            alive[rows] = ~trie.is_terminal[nodes[rows]]
        return tokens, valid, col

    def logprobs(
        self,
        logits: torch.Tensor,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        filters: Filters | Sequence[Filters] = Filters(),
    ) -> Replayed:
        """logits [B, S, V] of the trainer's forward on prompt + output (right-padded:
        logits[i, j] predicts token j + 1 of sequence i); one Filters, or one per sequence."""
        b = len(prompts)
        if not isinstance(filters, Filters) and len(filters) != b:
            raise ValidationError(f"{len(filters)} filters for {b} sequences")
        per = [filters] * b if isinstance(filters, Filters) else list(filters)
        plen = torch.tensor([len(p) for p in prompts])
        olen = torch.tensor([len(o) for o in outputs])
        if (plen < 1).any() or (plen + olen > logits.shape[1] + 1).any():
            raise ValidationError("every prompt needs a token, and logits one position per token")
        steps = int(olen.max()) if b else 0
        t_idx = torch.arange(steps)
        out_mask = t_idx[None] < olen[:, None]
        pos = (plen[:, None] - 1 + t_idx[None]).clamp(max=logits.shape[1] - 1)
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        rows = torch.arange(b, device=logits.device)[:, None]
        z = logits[rows, pos.to(logits.device)]  # [B, T, V]: the logits that chose each token
        dev = z.device  # the index tensors are built on the host, then moved once
        out_mask = out_mask.to(dev)
        tau = torch.tensor([f.tau for f in per], dtype=z.dtype, device=dev)[:, None, None]
        if self.catalog is None:
            chosen = torch.tensor([list(o) + [0] * (steps - len(o)) for o in outputs])
            xr, valid, col = z, torch.ones_like(z, dtype=torch.bool), chosen.to(dev)
            for i, f in enumerate(per):  # before min_new_tokens no token ends the sequence
                if f.min_new_tokens and f.stop_token_ids:
                    valid[i, : f.min_new_tokens, list(f.stop_token_ids)] = False
        else:
            tokens, valid, col = (t.to(dev) for t in self.supports(outputs, per, prompts))
            xr = z.gather(-1, tokens)
        lp = torch.log_softmax((xr / tau).masked_fill(~valid, NEG_INF), dim=-1)
        with torch.no_grad():
            keep = kept(lp.detach(), per) & valid
        lp = lp.masked_fill(~keep, NEG_INF)
        lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
        out = lp.gather(-1, col[..., None])[..., 0].masked_fill(~out_mask, 0.0)
        # prompt: plain log_softmax of the logits before each prompt token
        width = int(plen.max()) - 1
        j = torch.arange(width)
        prompt_mask = (j[None] < (plen - 1)[:, None]).to(logits.device)
        ids = torch.tensor([list(p[1:]) + [0] * (width - len(p) + 1) for p in prompts])
        ids = ids.to(logits.device)
        plp = torch.log_softmax(logits[:, :width], dim=-1).gather(-1, ids[..., None])[..., 0]
        return Replayed(out, out_mask, plp.masked_fill(~prompt_mask, 0.0), prompt_mask)


def kept(lp: torch.Tensor, filters: Sequence[Filters]) -> torch.Tensor:
    """lp [B, T, W] tempered log-probabilities over the allowed set (-inf: not allowed) -> the
    tokens top_k / top_p / min_p keep, each judged on lp: top-k the k most likely, top-p the
    most likely until the mass before a token passes p (the first always kept), min-p those at
    least min_p times as likely as the most likely. Deterministic beams (temperature 0) rank the
    whole allowed set: no filter applies."""
    b, t, w = lp.shape
    keep = torch.ones_like(lp, dtype=torch.bool)
    filters = [f if f.temperature > 0 else Filters() for f in filters]  # beams search it all
    dev = lp.device
    top_k = torch.tensor([f.top_k if 0 < f.top_k < w else w for f in filters], device=dev)
    top_p = torch.tensor([f.top_p for f in filters], dtype=lp.dtype, device=dev)
    min_p = torch.tensor([f.min_p for f in filters], dtype=lp.dtype, device=dev)
    top_k, top_p, min_p = top_k[:, None, None], top_p[:, None, None], min_p[:, None, None]
    if (min_p > 0).any():
        floor = lp.max(-1, keepdim=True).values + torch.log(min_p)
        keep &= lp >= floor
    if (top_k < w).any() or (top_p < 1).any():
        sorted_lp, order = lp.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        rank = torch.arange(w, device=dev)[None, None]
        drop = (rank >= top_k) | (probs.cumsum(-1) - probs > top_p)
        keep &= torch.empty_like(drop).scatter_(-1, order, ~drop)
    return keep
