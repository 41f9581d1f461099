"""Sequence: one request's state inside the engine, from submit to result."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from grctl.engine.kv_cache import BeamKV, ContextKV
from grctl.engine.request import GenerateRequest, GenerateResult, ItemResult, PromptLogprobs
from grctl.engine.search.beam import BeamResult, Beams
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
    ):
        self.request_id = request_id
        self.catalog = catalog
        self.banned = banned
        self.excluded = excluded
        self.req = req
        self.prompt_key = tuple(req.input_ids)  # the prefix cache's key
        self.prompt = torch.tensor(self.prompt_key, dtype=torch.int64)
        self.stop_ids = stop_ids
        self.arrival = time.monotonic()
        self.status = Status.WAITING
        self.abort_requested = False  # set while its step computes; the worker ends it after
        self.weight_versions: list[str] = []
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

    def record_version(self, version: str) -> None:
        if not self.weight_versions or self.weight_versions[-1] != version:
            self.weight_versions.append(version)

    def retract(self) -> None:
        """Drop the KV and outputs: the request restarts from its prompt when admitted again."""
        self._reset()
        self.weight_versions = []
        self.status = Status.WAITING

    def release_kv(self) -> None:
        self.ctx = None
        self.beam_kv = None

    def to_result(self, weight_version: str, aborted: bool = False) -> GenerateResult:
        beams = self.beams.results(aborted) if self.beams else []
        if not self.req.return_logprob:
            for b in beams:
                b.output_token_logprobs = b.output_top_logprobs = None
        top = beams[0] if beams else None
        reason = "abort" if aborted or top is None else top.finish_reason
        if not aborted and self.req.sampling.max_new_tokens == 0 and self.prefilled:
            reason = "length"
        versions = list(self.weight_versions)
        return GenerateResult(
            request_id=self.request_id,
            prompt_tokens=self.num_prompt_tokens,
            output_ids=list(top.output_ids) if top else [],
            finish_reason=reason,
            matched_stop=top.matched_stop if top is not None and reason == "stop" else None,
            beams=beams,
            weight_version=versions[-1] if versions else weight_version,
            weight_versions=versions,
            output_token_logprobs=(top.output_token_logprobs if top else [])
            if self.req.return_logprob
            else None,
            cached_tokens=self.cached_tokens,
            prompt_logprobs=self.prompt_logprobs if self.req.return_logprob else None,
            latency_s=time.monotonic() - self.arrival,
            item_results=self._item_results(beams),
            catalog_version=self.catalog.version if self.catalog is not None else None,
            text=self.req.text,
            beam_width=self.req.sampling.beam_width,
        )

    def _item_results(self, beams: list[BeamResult]) -> list[ItemResult] | None:
        """One row per beam, in beam order, naming each item once: a beam whose every item a
        better beam already named is left out (several paths may name one item)."""
        if self.catalog is None:
            return None
        out, seen = [], set()
        for rank, beam in enumerate(beams):
            ids = [i for i in self.catalog.item_ids(beam.node) if i not in self.excluded]
            fresh = [i for i in ids if i not in seen]
            if ids and not fresh:
                continue
            seen.update(fresh)
            tokens = list(beam.output_ids)
            out.append(ItemResult(rank, tokens, fresh, bool(fresh), beam.sequence_score))
        return out
