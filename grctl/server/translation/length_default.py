"""max_new_tokens when a request leaves it out.

Catalog beams default to the served catalog's depth (its longest item): every beam can then
complete an item, and each stops where its item ends. Anything else (use_catalog false, no
catalog, a multi-stage request's reasoning) takes SGLang's 128. Both stay within
--max-new-tokens and the context the prompt leaves (at least 1), so a default never turns a
valid prompt into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass

SGLANG_DEFAULT = 128  # SGLang's SamplingParams.max_new_tokens


@dataclass(frozen=True)
class LengthDefault:
    catalog_depth: int | None = None  # the served catalog's longest item; None: no catalog
    limit: int = SGLANG_DEFAULT  # --max-new-tokens
    context: int | None = None  # the engine's context limit; None: unbounded

    @classmethod
    def of_engine(cls, engine) -> LengthDefault:
        store = engine.catalogs
        catalog = store.current if store is not None else None
        return cls(
            catalog_depth=catalog.trie.stats.max_depth if catalog is not None else None,
            limit=engine.config.max_new_tokens,
            context=engine.max_context_len,
        )

    def of(self, use_catalog: bool, prompt_len: int) -> int:
        wanted = self.catalog_depth if use_catalog and self.catalog_depth else SGLANG_DEFAULT
        room = self.context - prompt_len if self.context is not None else wanted
        return max(1, min(wanted, self.limit, room))


FREE = LengthDefault()  # no server at hand (a client-side translation, a test)
