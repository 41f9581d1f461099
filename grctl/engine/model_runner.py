"""ModelRunner: the engine's two forward passes over our Qwen3, tensors only.

Prefill packs the prompts of a batch into one token stream, so every projection and MLP matmul
runs once over all of them; attention runs per prompt. A prompt whose first tokens are cached
(the prefix cache) computes only the rest, at their positions, attending to the cached KV too.
Only the last token's logits are needed (and, for a prompt scored from logprob_start_len, those
of its scored positions, computed in chunks of rows: prompt_logprobs.py), so the last layer
computes k and v for every token but q, attention and the MLP for those rows alone. Decode runs
one token for every beam of every request in one batch of rows; its attention reads each
request's own context where it lies (decode_batch.py).
"""

from __future__ import annotations

import torch

from grctl.engine.context_attention import RaggedContext
from grctl.engine.decode_batch import DecodeBatch, DecodeItem
from grctl.engine.kv_cache import ContextKV, chained
from grctl.engine.prompt_logprobs import Scoring, score
from grctl.model import batch_invariant
from grctl.model.attention import prefill_attention
from grctl.model.device import bind_thread
from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.model.rope import rope_cos_sin


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, device: torch.device):
        self.model = model
        self.device = device
        self.config = model.config
        self.dtype = model.embed_tokens.weight.dtype
        self.graphs = None  # a DecodeGraphs when decode runs through CUDA graphs
        # decode's context attention backend: the seam for FlashInfer's cascade decode
        self.context_attention = RaggedContext

    def capture_graphs(self) -> None:
        """Decode through CUDA graphs from now on, one per batch bucket (CUDA only)."""
        from grctl.engine.cuda_graphs import DecodeGraphs

        bind_thread(self.device)  # the capture stream and pool belong to the model's device
        self.graphs = DecodeGraphs(self.model, self.device)

    def _rope(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(positions, self.config, seq_lens)
        return cos.to(self.dtype), sin.to(self.dtype)

    @torch.inference_mode()
    def prefill(
        self,
        prompts: list[torch.Tensor],
        prefixes: list[list[ContextKV]] | None = None,
        scores: list[Scoring | None] | None = None,
    ) -> tuple[list[ContextKV], torch.Tensor]:
        """prompts: 1-D token tensors; prefixes: per prompt, the cached KV of the tokens before
        it, in parts (none: it starts at position 0); scores: per prompt, the positions before
        its last token whose next-token log-probabilities to fill in (prompt_logprobs.py).
        Returns each prompt's ContextKV (its own tokens' KV, continuing its prefix's parts by
        reference: nothing of them is copied) and last-token log-probabilities
        [len(prompts), vocab] in float32."""
        model, dev = self.model, self.device
        prefixes = prefixes or [[] for _ in prompts]
        scores = scores or [None] * len(prompts)
        starts = [sum(part.own_length for part in parts) for parts in prefixes]
        lens = [int(p.numel()) for p in prompts]
        ends = torch.tensor(lens).cumsum(0).tolist()
        bounds = [(e - n, e) for e, n in zip(ends, lens, strict=True)]
        ids = torch.cat(prompts).to(dev, non_blocking=True)
        spans = list(zip(starts, lens, strict=True))
        positions = torch.cat([torch.arange(p, p + n) for p, n in spans]).to(dev, non_blocking=True)
        # the last layer's query rows: each prompt's last token, after its scored positions
        extra = [0 if sc is None else sc.rows for sc in scores]
        rows = [torch.arange(e - 1 - x, e) for (_, e), x in zip(bounds, extra, strict=True)]
        rows = torch.cat(rows).to(dev, non_blocking=True)
        # a prompt's tokens are computed in one call of its length (dynamic RoPE reads it)
        seq_lens = torch.cat([torch.full((n,), p + n) for p, n in spans]).to(dev, non_blocking=True)
        cos, sin = self._rope(positions, seq_lens)
        ks: list[list[torch.Tensor]] = [[] for _ in prompts]
        vs: list[list[torch.Tensor]] = [[] for _ in prompts]
        h = model.embed_tokens(ids)  # [tokens, hidden]
        invariant = model.invariant
        for i, layer in enumerate(model.layers[:-1]):
            q, k, v = layer.pre_attention(h, cos, sin)  # [tokens, H or KV, D]
            outs = []
            for r, (s, e) in enumerate(bounds):
                kr, vr = k[s:e].transpose(0, 1).contiguous(), v[s:e].transpose(0, 1).contiguous()
                ks[r].append(kr)
                vs[r].append(vr)
                keys, values = _after(prefixes[r], i, kr, vr)
                if invariant:
                    outs.append(_invariant_attention(q[s:e], keys, values, positions[s:e]))
                else:
                    outs.append(prefill_attention(q[s:e], keys, values, causal=True))
            h = layer.post_attention(h, torch.cat(outs))
        i, layer = len(model.layers) - 1, model.layers[-1]
        x = layer.input_layernorm(h)
        if invariant:  # every token's q, k and v as decode and a trainer compute them
            q, k, v = layer.self_attn.project(x, cos, sin)
            q = q[rows]
        else:
            k, v = layer.self_attn.project_kv(x, cos, sin)
            q = layer.self_attn.project_q(x[rows], cos[rows], sin[rows])  # [query rows, H, D]
        outs, at = [], 0
        for r, (s, e) in enumerate(bounds):
            kr, vr = k[s:e].transpose(0, 1).contiguous(), v[s:e].transpose(0, 1).contiguous()
            ks[r].append(kr)
            vs[r].append(vr)
            keys, values = _after(prefixes[r], i, kr, vr)
            n = extra[r] + 1
            if invariant:
                outs.append(
                    _invariant_attention(q[at : at + n], keys, values, positions[e - n : e])
                )
            else:
                outs.append(prefill_attention(q[at : at + n], keys, values, causal=n > 1))
            at += n
        h = layer.post_attention(h[rows], torch.cat(outs))  # [query rows, hidden]
        if any(extra):  # each prompt's last row follows its scored ones
            last_h = h[((torch.tensor(extra) + 1).cumsum(0) - 1).to(dev)]
        else:
            last_h = h
        logprobs = torch.log_softmax(model.logits(last_h), dim=-1)
        at = 0
        for r, sc in enumerate(scores):
            if sc is not None and sc.rows:
                targets = prompts[r][lens[r] - sc.rows :].to(dev, non_blocking=True)
                sc.logprobs, sc.top = score(model, h[at : at + sc.rows], targets, sc.top_k)
            at += extra[r] + 1
        ctxs = [
            ContextKV(tuple(kr), tuple(vr), chained(parts))
            for kr, vr, parts in zip(ks, vs, prefixes, strict=True)
        ]
        return ctxs, logprobs

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One token per beam of every item; writes each beam's KV at its `step`.

        Returns logits [total beams, vocab] in float32, items in order: the search
        (beam_select.py) takes a log-sum-exp and a top-k per row, never a full log-softmax."""
        ids = torch.cat([it.input_ids for it in items]).to(self.device, non_blocking=True)
        positions = torch.cat(
            [torch.full((it.beam_kv.num_beams,), it.ctx.length + it.step) for it in items]
        ).to(self.device, non_blocking=True)
        batch = DecodeBatch(items, self.config, self.device, self.context_attention)
        if self.graphs is not None and self.graphs.fits(ids.shape[0]):
            logits = self.graphs.run(
                ids, positions, lambda i, q, k, v, out: _into(out, batch.attend(i, q, k, v))
            )
        else:
            cos, sin = self._rope(positions)
            h = self.model.embed_tokens(ids)  # [beams, hidden]
            for i, layer in enumerate(self.model.layers):
                q, k, v = layer.pre_attention(h, cos, sin)
                h = layer.post_attention(h, batch.attend(i, q, k, v))
            logits = self.model.logits(h)
        batch.finish()
        return logits


def _after(
    prefix: list[ContextKV], layer: int, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [KV, S, D] of a prompt's new tokens -> the keys its prefill attends to, [KV, P + S,
    D]: the cached prefix's first (a temporary of this layer; the context keeps the parts)."""
    if not prefix:
        return k, v
    return (
        torch.cat([*(part.k[layer] for part in prefix), k], dim=1),
        torch.cat([*(part.v[layer] for part in prefix), v], dim=1),
    )


def _invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Causal prefill attention, batch-invariant (model/batch_invariant.py): [S_q, H * D]."""
    return batch_invariant.attention(q, k, v, positions)[0].to(q.dtype).flatten(1)


def _into(out: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    out[: attn.shape[0]] = attn  # a CUDA graph's static buffer [bucket, H * D]
    return out
