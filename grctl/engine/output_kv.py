"""Keeping a finished sample's own KV in the prefix cache (GenerateRequest.keep_output_kv), so
the request that continues it (a multi-stage request's item stage: prompt + reasoning + prefix,
engine/stages.py) prefills only what follows instead of the reasoning again.

A width-1 request that ends by its tokens (not aborted) holds its prompt's context KV and its
beam's tail, step s the KV of output token s; the last output token was never fed, so the
prompt plus all of its output but the last token is inserted, without last-token logprobs (not
an exact-repeat entry: a lookup of it computes its last token), under the weights tag of the
step that decoded it, and only when that is the tag its KV was computed under (an in_place
pause with a write leaves older weights' KV under newer tokens: never kept). Inserting under a
tag a write has since passed only empties the tree; lookups are tagged, so no KV of other
weights is ever read.
"""

from __future__ import annotations

from dataclasses import dataclass

from grctl.engine.kv_cache import BeamKV, ContextKV
from grctl.engine.prefix_cache import PrefixCache


@dataclass(eq=False)
class KeptKV:
    ctx: ContextKV
    beam_kv: BeamKV
    tag: str


def keep(seq, tag: str) -> None:
    """At the step that ends `seq` (before its KV is released), when it asked."""
    if not (seq.req.keep_output_kv and seq.req.sampling.width == 1 and seq.beam_kv is not None):
        return
    if seq.kv_tag == tag:  # else part of it is older weights' (an in_place pause's frozen KV)
        seq.kept_kv = KeptKV(seq.ctx, seq.beam_kv, tag)


def insert(cache: PrefixCache, seq, output_ids: list[int], finish_reason: str) -> None:
    """Into the cache, once its result is built and before anyone is woken by it."""
    kept, seq.kept_kv = getattr(seq, "kept_kv", None), None
    n = len(output_ids) - 1
    if kept is None or n <= 0 or finish_reason == "abort":
        return
    data = kept.beam_kv.data  # [layers, 2, beams, kv_heads, steps, head_dim]
    layers = range(data.shape[0])
    tail = ContextKV(
        tuple(data[i, 0, 0, :, :n] for i in layers),
        tuple(data[i, 1, 0, :, :n] for i in layers),
        kept.ctx,
    )
    cache.insert((*seq.prompt_key, *output_ids[:n]), tail, None, kept.tag)
