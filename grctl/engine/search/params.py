"""SamplingParams: how one request searches (width, temperature, filters, stops, the catalog)."""

from __future__ import annotations

from dataclasses import dataclass

from grctl.engine.search.logits_processors import LogitsRule


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 1
    # grctl's form (recsys-examples): n is the beam width and every beam is returned. SGLang's
    # form: beam_width W searches W beams and returns the best n <= W.
    n: int = 1
    beam_width: int | None = None
    temperature: float = 0.0  # 0: greedy / deterministic beams; > 0: samples (without replacement)
    top_p: float = 1.0
    top_k: int = -1  # -1 (or >= vocab): whole vocab
    min_p: float = 0.0
    seed: int | None = None  # None: a random seed per request
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: n == 1, needs the server's tokenizer
    ignore_eos: bool = False  # True: neither EOS nor stop_token_ids end a sequence
    min_new_tokens: int = 0  # no sequence ends before this many tokens
    # deterministic beams rank finished ones by score / length ** length_penalty (0: the
    # cumulative log-probability, transformers' length_penalty=0)
    length_penalty: float = 0.0
    use_catalog: bool = True  # constrain to the served item catalog, when one is loaded
    exclude_item_ids: tuple[int | str, ...] = ()  # no beam completes these catalog items
    # the prompt's last k tokens begin the item to complete (None: the catalog's rule,
    # catalog/resume.py)
    item_prefix_len: int | None = None
    logits_processors: tuple[LogitsRule, ...] = ()

    @property
    def width(self) -> int:
        """The number of beams searched."""
        return self.beam_width if self.beam_width is not None else self.n

    @property
    def is_stochastic(self) -> bool:
        """Sampled: one sequence at width 1, `width` distinct ones (without replacement) above."""
        return self.temperature > 0
