"""What the engine takes and gives back: plain dataclasses, no HTTP in here."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    return_logprob: bool = False
    request_id: str | None = None  # None: the engine assigns one


@dataclass
class BeamResult:
    output_ids: list[int]
    sequence_score: float  # cumulative log-probability of output_ids
    finish_reason: str  # "length" | "stop" | "abort"


@dataclass
class GenerateResult:
    request_id: str
    prompt_tokens: int
    output_ids: list[int]  # the top sequence
    finish_reason: str  # "length" | "stop" | "abort"
    matched_stop: int | None  # the stop token that ended the top sequence, if any
    beams: list[BeamResult]  # n > 1: every beam, best first; n == 1: the one sequence
    weight_version: str  # the version the request finished on
    weight_versions: list[str]  # every version its tokens were computed with, in order
    output_token_logprobs: list[float] | None = None  # per output token, when asked
    cached_tokens: int = 0  # prompt tokens served from the prefill cache
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return sum(len(b.output_ids) for b in self.beams) or len(self.output_ids)
