"""Sequence: one request's state inside the engine, from submit to result."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from grctl.catalog.resume import ROOT, ItemStart
from grctl.engine.kv_cache import BeamKV, ContextKV
from grctl.engine.request import GenerateRequest, GenerateResult, ItemResult, PromptLogprobs
from grctl.engine.search import beam_results
from grctl.engine.search.beam import NO_ITEM, BeamResult, Beams
from grctl.engine.search.stop_strings import StopStrings

if TYPE_CHECKING:
    from grctl.catalog.store import Catalog


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        req: GenerateRequest,
        stop_ids: tuple[int, ...],
        catalog: Catalog | None = None,  # taken at submit: the request keeps this version
        banned: torch.Tensor | None = None,  # the catalog's nodes its exclude_item_ids close
        excluded: frozenset = frozenset(),  # those ids, as the catalog spells them
        unknown_excluded: tuple = (),  # the ids it excludes that name no item, as sent
        item_start: ItemStart = ROOT,  # where its item starts: the root, or a partial item
    ):
        self.request_id = request_id
        self.catalog = catalog
        self.banned = banned
        self.excluded = excluded
        self.unknown_excluded = unknown_excluded
        self.item_start = item_start
        self.req = req
        self.prompt_key = tuple(req.input_ids)  # the prefix cache's key
        self.prompt = torch.tensor(self.prompt_key, dtype=torch.int64)
        self.stop_ids = stop_ids
        self.arrival = time.monotonic()
        self.status = Status.WAITING
        self.abort_requested = False  # set while its step computes; the worker ends it after
        # the weight version of every output position: position t of every beam was chosen by
        # the request's t-th advance, whichever beam it reached later
        self.token_versions: list[str] = []
        self.last_version: str | None = None  # of its last step (a prefill-only one has no token)
        self.num_retractions = 0
        self.kv_recomputed_at: list[int] = []  # output lengths at which its KV was recomputed
        self._reset()

    def _reset(self) -> None:
        self.beams: Beams | None = None
        sp = self.req.sampling
        self.stop_strings = (
            StopStrings(sp.stop, self.req.detokenize) if sp.stop and self.req.detokenize else None
        )
        self.ctx: ContextKV | None = None
        self.beam_kv: BeamKV | None = None
        self.cached_tokens = 0
        self.kept_kv = None  # engine/output_kv.py: its KV kept past its end, to be cached
        self.kv_tag = ""  # the weights tag its KV was (re)computed under
        self.prefilled = False
        self.prompt_logprobs: PromptLogprobs | None = None  # logprob_start_len's scores

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.req.input_ids)

    @property
    def num_beams(self) -> int:
        return self.req.sampling.width

    @property
    def holds_kv(self) -> bool:
        return self.ctx is not None

    @property
    def is_done(self) -> bool:
        if self.req.sampling.max_new_tokens == 0:  # prefill only
            return self.prefilled
        return self.beams is not None and self.beams.is_done

    @property
    def is_started(self) -> bool:
        """Its search has chosen tokens (a retracted one keeps them)."""
        return self.beams is not None and self.beams.is_started

    @property
    def needs_recompute(self) -> bool:
        """Retracted with tokens, and its KV dropped since: the prompt and each beam's tokens
        must be computed again before it decodes on."""
        return self.is_started and not self.holds_kv

    def record_version(self, version: str) -> None:
        """Every output position chosen since the last call was chosen under `version`."""
        num = self.beams.num_steps if self.beams is not None else 0
        self.token_versions.extend([version] * (num - len(self.token_versions)))
        self.last_version = version

    def retract(self) -> None:
        """Back to the queue (SGLang's retract): a request that has chosen tokens keeps them,
        its beams and its KV, and continues where it was; a weight write before it runs again
        drops the KV (`drop_stale_kv`) and it is recomputed. One not started restarts."""
        self.num_retractions += 1
        if not self.is_started:
            self._reset()
            self.last_version = None
        self.status = Status.WAITING

    def drop_stale_kv(self) -> bool:
        """The weights were written while it waited retracted: its KV is of the old ones."""
        if not (self.is_started and self.holds_kv):
            return False
        self.release_kv()
        return True

    def release_kv(self) -> None:
        self.ctx = None
        self.beam_kv = None

    def to_result(self, weight_version: str, aborted: bool = False) -> GenerateResult:
        beams = beam_results.walk(self.beams, aborted) if self.beams else []
        if not self.req.return_logprob:
            for b in beams:
                b.output_token_logprobs = b.output_top_logprobs = None
        top = beams[0] if beams else None
        reason = "abort" if aborted else top.finish_reason if top is not None else "abort"
        if top is None and not aborted and self.catalog is not None and self.beams is not None:
            reason = NO_ITEM  # the search ran: no item its constraints allow is reachable
        if not aborted and self.req.sampling.max_new_tokens == 0 and self.prefilled:
            reason = "length"
        versions = distinct(self.token_versions)
        if not versions and self.last_version is not None:  # prefill only: the prompt's
            versions = [self.last_version]
        return GenerateResult(
            request_id=self.request_id,
            prompt_tokens=self.num_prompt_tokens,
            output_ids=list(top.output_ids) if top else [],
            finish_reason=reason,
            matched_stop=top.matched_stop if top is not None and reason == "stop" else None,
            beams=beams,
            weight_version=versions[-1] if versions else weight_version,
            weight_versions=versions,
            token_versions=list(self.token_versions),
            num_retractions=self.num_retractions,
            kv_recomputed_at=list(self.kv_recomputed_at),
            output_token_logprobs=(top.output_token_logprobs if top else [])
            if self.req.return_logprob
            else None,
            # SGLang recomputes an exact repeat's last token: at most all but it (grctl reuses
            # the stored logits; the prefix cache's own hit_tokens count the whole prompt)
            cached_tokens=min(self.cached_tokens, self.num_prompt_tokens - 1),
            prompt_logprobs=self.prompt_logprobs if self.req.return_logprob else None,
            latency_s=time.monotonic() - self.arrival,
            item_results=self._item_results(beams),
            catalog_version=self.catalog.version if self.catalog is not None else None,
            item_prefix_len=self.item_start.depth if self.catalog is not None else None,
            text=self.req.text,
            beam_width=self.req.sampling.beam_width,
            gumbel_threshold=self.beams.gumbel_threshold if self.beams else None,
            unknown_exclude_item_ids=list(self.unknown_excluded),
        )

    def _item_results(self, beams: list[BeamResult]) -> list[ItemResult] | None:
        """One row per beam, in beam order, naming each item once: a beam whose every item a
        better beam already named is left out (several paths may name one item)."""
        if self.catalog is None:
            return None
        out, seen = [], set()
        depth = self.item_start.depth  # a resumed item's path begins in the prompt
        prefix = list(self.req.input_ids[len(self.req.input_ids) - depth :]) if depth else []
        for rank, beam in enumerate(beams):
            ids = [i for i in self.catalog.item_ids(beam.node) if i not in self.excluded]
            fresh = [i for i in ids if i not in seen]
            if ids and not fresh:
                continue
            seen.update(fresh)
            tokens = prefix + list(beam.output_ids)
            out.append(ItemResult(rank, tokens, fresh, bool(fresh), beam.sequence_score))
        return out


def distinct(versions: list[str]) -> list[str]:
    """The versions in order, each run of one version once."""
    return [v for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v]
