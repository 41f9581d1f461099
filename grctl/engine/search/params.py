"""SamplingParams: how one request searches (width, temperature, filters, stops, the catalog)."""

from __future__ import annotations

from dataclasses import dataclass

from grctl.engine.search.logits_processors import LogitsRule


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 1
    n: int = 1  # n > 1: beam search of width n
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocab
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # True: neither EOS nor stop_token_ids end a sequence
    use_catalog: bool = True  # constrain to the served item catalog, when one is loaded
    logits_processors: tuple[LogitsRule, ...] = ()
