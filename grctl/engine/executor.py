"""Executor: runs one scheduled step on the model, and moves each request's beams forward.

Prefill goes through the prefix cache: a prompt whose first tokens were prefilled before under the
same weights computes only the rest (an exact repeat skips the model), and prompts of one batch
that share a prefix compute it once; then the first token(s) come from the prefill's
log-probabilities (and a scored prompt's per-token scores, prompt_logprobs.py). Decode runs every
running request's beams in one batch, advances each request's beams and reorders its beam KV.

What one request does alone after the batched selection (its stop strings, its beam KV) is done
request by request: a failure there makes that request a culprit (`take_culprits`, ended by the
worker) and the others go on. Before a decode selection draws noise, each stochastic request's
generator state is marked, so a request re-run alone after a failed step draws what it would
have drawn (`rewind`).
"""

from __future__ import annotations

import torch

from grctl.engine import output_kv, prompt_logprobs
from grctl.engine.decode_batch import DecodeItem
from grctl.engine.kv_cache import BeamKV, ContextKV, chained
from grctl.engine.model_runner import ModelRunner
from grctl.engine.prefix_cache import Match, PrefixCache, join_kv
from grctl.engine.search import beam_select, sampler
from grctl.engine.search.beam import Beams
from grctl.engine.search.beam_select import Block
from grctl.engine.sequence import Sequence


class Executor:
    def __init__(
        self,
        runner: ModelRunner,
        cache: PrefixCache,
        original_logprob: bool = False,
        mask_max_tokens: int = 4096,
        join_contexts: bool = False,
        invariant_rows: bool = False,
    ):
        self.runner = runner
        self.cache = cache
        self._tag = ""  # the step's prefix-cache tag (output_kv.keep)
        self.original_logprob = original_logprob  # the default of return_original_logprob
        self.mask_max_tokens = mask_max_tokens  # the widest support a sampling mask lists
        # deterministic inference: a context continuing cached parts is joined into one part
        # once, at prefill, so that decode attends to it as to an uncached prompt
        self.join_contexts = join_contexts
        self.invariant_rows = invariant_rows  # and each row's selection reduced on its own
        cfg = runner.config
        self.max_cached_len = (
            cfg.max_position_embeddings if cfg.rope.rope_type == "dynamic" else None
        )
        self.device = runner.device
        self.num_prefill_batches = 0
        self.num_prefill_tokens = 0  # computed, cache hits excluded
        self.num_decode_steps = 0
        self.num_decode_rows = 0
        self.culprits: dict[int, BaseException] = {}  # id(seq) -> what failed for it alone
        self._marks: dict[int, tuple[int, torch.Tensor]] = {}  # id(seq) -> (num_steps, rng)

    def stats(self) -> dict:
        return {
            "prefill_batches": self.num_prefill_batches,
            "prefill_tokens": self.num_prefill_tokens,
            "decode_steps": self.num_decode_steps,
            "decode_rows": self.num_decode_rows,
        }

    def run(
        self, prefill: list[Sequence], decode: list[Sequence], version: str, cache_tag: str = ""
    ) -> None:
        """One step. `version` labels the tokens; `cache_tag` keys the prefix cache."""
        self._tag = cache_tag or version
        if prefill:
            self._prefill(prefill, version, cache_tag or version)
        decode = decode + [s for s in prefill if not s.is_done and id(s) not in self.culprits]
        if decode:
            self._decode(decode, version)

    def take_culprits(self) -> dict[int, BaseException]:
        """The requests that failed alone since the last call (id(seq) -> the error)."""
        out, self.culprits = self.culprits, {}
        return out

    def marks(self) -> dict[int, tuple[int, torch.Tensor]]:
        """The generator states marked before the last decode selection (for `rewind`)."""
        return self._marks

    @staticmethod
    def rewind(seq: Sequence, marks: dict[int, tuple[int, torch.Tensor]]) -> None:
        """Put a request's generator back where `marks` found it before a decode selection, if
        that selection did not advance it (it failed)."""
        mark = marks.get(id(seq))
        gen = seq.beams.generator if seq.beams is not None else None
        if mark is not None and gen is not None and mark[0] == seq.beams.num_steps:
            gen.set_state(mark[1])

    def _alone(self, seq: Sequence, what, *args) -> None:
        """One request's own work after the batched selection; a failure makes it a culprit."""
        try:
            what(*args)
        except Exception as exc:
            self.culprits[id(seq)] = exc

    def _prefill(self, seqs: list[Sequence], version: str, cache_tag: str) -> None:
        """Prompts sharing a prefix with an earlier one of the batch wait for a second pass,
        run against the KV the first pass cached. A retracted request that kept its KV only
        decodes on; one that lost it is recomputed."""
        seqs = [s for s in seqs if not s.is_started or s.needs_recompute]
        keys = [s.prompt_key if self.is_cacheable(s) else () for s in seqs]
        waits = self.cache.waits(keys, cache_tag)
        for wave in (False, True):
            todo = [s for s, w in zip(seqs, waits, strict=True) if w is wave]
            if todo:
                self._start(self._prefill_wave(todo, cache_tag), version)

    def _prefill_wave(
        self, seqs: list[Sequence], cache_tag: str
    ) -> list[tuple[Sequence, ContextKV, torch.Tensor]]:
        started, todo = [], []
        for seq in seqs:
            limit = prompt_logprobs.cache_limit(seq.req)  # scored tokens are computed
            match = (
                self.cache.lookup(seq.prompt_key, cache_tag, limit)
                if self.is_cacheable(seq)
                else Match()
            )
            if not seq.is_started:  # a recomputed one keeps what its first prefill found
                seq.cached_tokens = match.num_tokens
            if match.logprobs is not None:  # an exact repeat: no model call
                started.append((seq, chained(match.parts), match.logprobs))
            else:
                todo.append((seq, match))
        if todo:
            scores = [prompt_logprobs.scoring_of(seq.req) for seq, _ in todo]
            ctxs, logprobs = self.runner.prefill(
                [seq.prompt[m.num_tokens :] for seq, m in todo], [m.parts for _, m in todo], scores
            )
            for (seq, _), sc in zip(todo, scores, strict=True):
                if sc is not None:
                    seq.prompt_logprobs = prompt_logprobs.assemble(seq.req, sc)
            self.num_prefill_batches += 1
            self.num_prefill_tokens += sum(seq.num_prompt_tokens - m.num_tokens for seq, m in todo)
            for (seq, _), ctx, lp in zip(todo, ctxs, logprobs, strict=True):
                if self.is_cacheable(seq):
                    self.cache.insert(seq.prompt_key, ctx, lp, cache_tag)
                started.append((seq, ctx, lp))
        return started

    def is_cacheable(self, seq: Sequence) -> bool:
        """Dynamic RoPE computes a prompt longer than max_position_embeddings with frequencies
        of its own length: such a prompt's KV is neither reused nor kept."""
        return self.max_cached_len is None or seq.num_prompt_tokens <= self.max_cached_len

    def _start(self, started: list[tuple[Sequence, ContextKV, torch.Tensor]], version: str) -> None:
        """The first token(s) of every started request, from its prefill row, in one step (a
        prefill-only request, max_new_tokens 0, is done; a retracted one is recomputed)."""
        for seq, ctx, _ in started:
            if seq.is_started:
                self._recompute(seq, ctx)
        started = [(seq, ctx, lp) for seq, ctx, lp in started if not seq.is_started]
        cfg = self.runner.config
        for seq, _, _ in started:
            seq.prefilled = True
            if seq.req.sampling.max_new_tokens == 0:
                seq.record_version(version)
        started = [s for s in started if s[0].req.sampling.max_new_tokens > 0]
        if not started:
            return
        blocks = []
        for i, (seq, _, _) in enumerate(started):
            seq.beams = Beams(
                seq.req.sampling,
                seq.stop_ids,
                cfg.vocab_size,
                self.device,
                seq.catalog.trie if seq.catalog is not None else None,
                seq.banned,
                seq.req.top_logprobs_num if seq.req.return_logprob else 0,
                self.original_logprob
                if seq.req.return_original_logprob is None
                else seq.req.return_original_logprob,
                seq.req.return_logprob,
                sampling_mask=self.mask_max_tokens + 1 if seq.req.return_sampling_mask else 0,
                start=(seq.item_start.node, seq.item_start.depth),
            )
            blocks.append(Block(seq.beams, i, 1))
        with sampler.row_invariant(self.invariant_rows):
            beam_select.step(torch.stack([lp for _, _, lp in started]), blocks)
        self._match_stop_strings([s for s, _, _ in started])
        for seq, ctx, _ in started:
            if id(seq) not in self.culprits:
                self._alone(seq, self._started, seq, ctx, version)

    def _started(self, seq: Sequence, ctx: ContextKV, version: str) -> None:
        seq.record_version(version)
        if seq.beams.is_done:
            return
        sp = seq.req.sampling
        seq.ctx, seq.beam_kv = self._context(ctx), self._beam_kv(sp.width, sp.max_new_tokens)
        seq.kv_tag = self._tag  # the weights its KV was computed with (output_kv.keep)

    def _context(self, ctx: ContextKV) -> ContextKV:
        """A started request's context: with join_contexts, one part (a copy of its chain)."""
        return join_kv(ctx.parts) if self.join_contexts and ctx.prefix is not None else ctx

    def _beam_kv(self, width: int, max_new_tokens: int) -> BeamKV:
        cfg = self.runner.config
        return BeamKV(
            cfg.num_layers,
            width,
            cfg.num_kv_heads,
            max_new_tokens - 1,
            cfg.head_dim,
            self.runner.dtype,
            self.device,
        )

    def _recompute(self, seq: Sequence, ctx: ContextKV) -> None:
        """A retracted request whose KV a weight write dropped: its prompt was prefilled again
        (`ctx`); each running beam feeds its own tokens but the last, one decode pass per
        position, logits unused, so its tails hold its own path's KV under these weights. Its
        beams, pool and tokens stay as they were; it decodes on from here."""
        sp, steps = seq.req.sampling, seq.beams.num_steps
        ctx = self._context(ctx)
        beam_kv = self._beam_kv(sp.width, sp.max_new_tokens)
        paths = seq.beams.running_paths()
        for t in range(steps - 1):
            self.runner.decode([DecodeItem(ctx, beam_kv, paths[:, t], t)])
        self.num_prefill_tokens += (steps - 1) * sp.width
        seq.ctx, seq.beam_kv = ctx, beam_kv  # only now: a failure above leaves it to recompute
        seq.kv_tag = self._tag
        seq.kv_recomputed_at.append(steps)

    def _decode(self, seqs: list[Sequence], version: str) -> None:
        items = [
            DecodeItem(s.ctx, s.beam_kv, s.beams.next_input(), s.beams.num_steps - 1) for s in seqs
        ]
        logits = self.runner.decode(items)  # [rows, vocab]
        self.num_decode_steps += 1
        self.num_decode_rows += logits.shape[0]
        blocks, row = [], 0
        for seq in seqs:
            blocks.append(Block(seq.beams, row, seq.num_beams))
            row += seq.num_beams
        self._marks = {
            id(s): (s.beams.num_steps, s.beams.generator.get_state())
            for s in seqs
            if s.beams.generator is not None
        }
        with sampler.row_invariant(self.invariant_rows):
            beam_select.step(logits, blocks)
        self._match_stop_strings(seqs)
        for seq, item in zip(seqs, items, strict=True):
            if id(seq) not in self.culprits:
                self._alone(seq, self._decoded, seq, item.step, version)

    def _decoded(self, seq: Sequence, step: int, version: str) -> None:
        seq.record_version(version)
        if seq.beams.is_done:
            output_kv.keep(seq, self._tag)
            seq.release_kv()
        elif seq.num_beams > 1:
            seq.beam_kv.reorder(seq.beams.parents(), step + 1)

    def _match_stop_strings(self, seqs: list[Sequence]) -> None:
        """End the width-1 requests whose text now holds one of their stop strings (one copy
        of the new tokens to the host for all of them)."""
        watched = [s for s in seqs if s.stop_strings is not None and not s.beams.is_done]
        if not watched:
            return
        tokens = torch.cat([s.beams.last_tokens() for s in watched]).tolist()
        for seq, token in zip(watched, tokens, strict=True):
            self._alone(seq, self._stop_string, seq, token)

    @staticmethod
    def _stop_string(seq: Sequence, token: int) -> None:
        matched = seq.stop_strings.push(token)
        if matched is not None:
            seq.beams.finish_running(matched)
