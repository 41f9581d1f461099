"""SGLang's sampling parameters on the wire -> the engine's SamplingParams and TextOptions.

What grctl implements is mapped; what it does not (penalties, grammars, logit_bias, prompt
logprobs...) is refused with a 400 naming the parameter, unless it holds the value that changes
nothing (frequency_penalty 0, repetition_penalty 1, an empty json_schema...), so that a trainer
recomputing log-probabilities never silently disagrees with what was sampled.
"""

from __future__ import annotations

from typing import Any

import msgspec

from grctl.engine.request import SamplingParams, TextOptions
from grctl.engine.search.logits_processors import parse_logits_processors
from grctl.errors import ValidationError
from grctl.protocol.generate import GenerateBody, SamplingParamsBody
from grctl.server.translation.length_default import FREE

# sampling_params keys grctl does not implement -> the values that change nothing
_NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "stop_regex": ("", ()),
    "json_schema": ("",),
    "regex": ("",),
    "ebnf": ("",),
    "structural_tag": ("",),
    "logit_bias": ({},),
    "watermark": ({},),
    "choice": ((),),
}
# top-level keys, the same way
_NEUTRAL_TOP: dict[str, tuple] = {
    "token_ids_logprob": ((),),
    "return_hidden_states": (False,),
    "custom_logit_processor": ("",),
    "lora_path": ("",),
}


def _is_neutral(value: Any, neutral: tuple) -> bool:
    if value is None:
        return True
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return any(type(value) is type(n) and value == n for n in neutral)
    return any(
        isinstance(n, (int, float)) and not isinstance(n, bool) and value == n for n in neutral
    )


def refuse_unimplemented(obj: Any, table: dict[str, tuple], where: str) -> None:
    bad = [name for name in table if not _is_neutral(getattr(obj, name), table[name])]
    if bad:
        names = ", ".join(bad)
        raise ValidationError(
            f"{where} {names}: not implemented by grctl",
            hint="leave them out (or at their no-op defaults); grctl implements temperature, "
            "top_p, top_k, min_p, min_new_tokens, stop, stop_token_ids, length_penalty, "
            "beam_width, logits_processors",
        )


def check_body(body: GenerateBody) -> None:
    """The top-level logprob and output options grctl does not implement: a 400 naming them."""
    refuse_unimplemented(body, _NEUTRAL_TOP, "")
    if body.sampling_logprobs_mode is not None and not body.return_sampling_mask:
        raise ValidationError(
            "sampling_logprobs_mode can only be set when return_sampling_mask=true",
            hint='send "return_sampling_mask": true, or leave sampling_logprobs_mode out',
        )


# sampling_params fields custom_params may carry: every one grctl implements. A gateway that
# rebuilds SGLang's SamplingParams (smg) keeps custom_params whole and drops the fields SGLang
# does not know (beam_width, use_catalog, exclude_item_ids, length_penalty, ...).
CUSTOM_FIELDS = frozenset(SamplingParamsBody.__struct_fields__) - set(_NEUTRAL) - {"custom_params"}
_DEFAULTS = SamplingParamsBody()
# the one foreign key custom_params may carry: slime's request (its patched SGLang's) for each
# output token's kept top-p ids, meta_info.top_p_token_ids / top_p_token_offsets
TOP_P_TOKEN_IDS = "return_top_p_token_ids"


def wants_top_p_token_ids(sp: SamplingParamsBody) -> bool:
    """custom_params.return_top_p_token_ids: true or false (absent: false), else a 400."""
    extra = sp.custom_params
    if not isinstance(extra, dict) or TOP_P_TOKEN_IDS not in extra:
        return False
    value = extra[TOP_P_TOKEN_IDS]
    if not isinstance(value, bool):
        raise ValidationError(
            f"sampling_params.custom_params.{TOP_P_TOKEN_IDS} must be true or false",
            hint=f'send "{TOP_P_TOKEN_IDS}": true, or leave it out',
        )
    return value


def with_custom_params(sp: SamplingParamsBody) -> SamplingParamsBody:
    """sampling_params with the fields of its custom_params set (docs/http-api.md): a field set
    both there and beside it to another value is a 400, as is a key grctl does not serve."""
    extra = sp.custom_params
    if extra is None:
        return sp
    if not isinstance(extra, dict):
        raise ValidationError(
            "sampling_params.custom_params must be an object of sampling_params fields",
            hint='e.g. {"beam_width": 8, "exclude_item_ids": [3, 9]}',
        )
    extra = {k: v for k, v in extra.items() if k != TOP_P_TOKEN_IDS}  # wants_top_p_token_ids'
    unknown = sorted(k for k in extra if k not in CUSTOM_FIELDS)
    if unknown:
        raise ValidationError(
            f"sampling_params.custom_params {', '.join(map(repr, unknown))}: not a grctl "
            "sampling field",
            hint="custom_params carries grctl's own sampling_params fields (beam_width, "
            f"use_catalog, exclude_item_ids, length_penalty, ...) and {TOP_P_TOKEN_IDS}; "
            "leave other keys out",
        )
    fields = {**msgspec.structs.asdict(sp), **extra, "custom_params": None}
    try:
        merged = msgspec.convert(fields, SamplingParamsBody, strict=False)
    except msgspec.ValidationError as exc:
        raise ValidationError(f"sampling_params.custom_params: {exc}") from exc
    clash = [
        k
        for k in extra
        if getattr(sp, k) != getattr(_DEFAULTS, k) and getattr(sp, k) != getattr(merged, k)
    ]
    if clash:
        raise ValidationError(
            f"sampling_params and its custom_params set {', '.join(sorted(clash))} differently",
            hint="send each field once",
        )
    return merged


def _first_set(*values: int | None) -> int:
    return next(v for v in values if v is not None)


def sampling_of(
    body: GenerateBody, sp: SamplingParamsBody, max_new_tokens: int | None = None
) -> SamplingParams:
    """`max_new_tokens`: the default (length_default.py) where `sp` leaves it out."""
    refuse_unimplemented(sp, _NEUTRAL, "sampling_params")
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise ValidationError("seed and sampling_seed differ; send one of them")
    stop = sp.stop if isinstance(sp.stop, list) else [sp.stop] if sp.stop is not None else []
    return SamplingParams(
        max_new_tokens=_first_set(sp.max_new_tokens, max_new_tokens, FREE.of(sp.use_catalog, 0)),
        n=sp.n,
        beam_width=sp.beam_width,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=sp.seed if sp.seed is not None else sp.sampling_seed,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        stop=tuple(stop),
        ignore_eos=sp.ignore_eos,
        min_new_tokens=sp.min_new_tokens,
        length_penalty=sp.length_penalty,
        use_catalog=sp.use_catalog,
        exclude_item_ids=tuple(sp.exclude_item_ids or ()),
        item_prefix_len=sp.item_prefix_len,
        logits_processors=parse_logits_processors(body.logits_processors)
        + parse_logits_processors(sp.logits_processors),
    )


def text_options_of(
    body: GenerateBody, sp: SamplingParamsBody, top_p_token_ids: bool = False
) -> TextOptions:
    return TextOptions(
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        no_stop_trim=sp.no_stop_trim,
        return_text_in_logprobs=body.return_text_in_logprobs,
        item_finish_reason=sp.item_finish_reason,
        sampling_logprobs_mode=body.sampling_logprobs_mode or "selected",
        sampling_mask=body.return_sampling_mask,
        top_p_token_ids=top_p_token_ids,
    )
