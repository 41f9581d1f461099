"""Multi-stage bodies (docs/http-api.md "Multi-stage requests") -> the engine's StagedRequest:
grctl's spelling (sampling_params.reasoning) or verl-GR's (decode_config, beam_search_params,
beam_width, and its legacy aliases, with verl-GR's defaults)."""

from __future__ import annotations

import dataclasses
from typing import Any

from grctl.engine.request import GenerateRequest
from grctl.engine.search.params import SamplingParams
from grctl.engine.stages import StagedRequest
from grctl.engine.validation import check_length_penalty, check_temperature, check_top_k
from grctl.errors import ValidationError
from grctl.protocol.generate import GenerateBody, SamplingParamsBody
from grctl.protocol.stages import BeamSearchParams, DecodeConfig, DecodePhase
from grctl.server.translation.length_default import SGLANG_DEFAULT

GRCTL_KEYS = ("reasoning",)
SHARED_KEYS = ("forced_prefix", "beam_return_mode", "beam_group_id", "beam_index")
VERL_GR_KEYS = (
    "decode_config",
    "beam_search_params",
    "return_all_beams",
    "stage2_beam_size",
    "beam_idx",
    "two_stage_group_id",
    "stage2_num_tokens",
    "stage2_max_tokens",
    "stage1_max_tokens",
    "stage2_temperature",
    "stage2_top_p",
    "stage2_top_k",
)
# verl-GR's defaults (beam_config.py)
VERL_GR_WIDTH, VERL_GR_ITEM_TOKENS, VERL_GR_LENGTH_PENALTY = 32, 16, 1.0
VERL_GR_STOP, VERL_GR_PREFIX = ("</think>",), "\n<|sid_begin|>"


def _set(sp: SamplingParamsBody, keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if getattr(sp, k) is not None]


def is_multi_stage(sp: SamplingParamsBody) -> bool:
    """Any multi-stage key set (enable_two_stage_rollout false alone asks for one stage)."""
    if sp.enable_two_stage_rollout is False:
        extra = _set(sp, (*GRCTL_KEYS, *SHARED_KEYS, *VERL_GR_KEYS))
        if extra:
            raise ValidationError(
                f"enable_two_stage_rollout is false but {', '.join(extra)} asks for two stages",
                hint="drop enable_two_stage_rollout, or the two-stage keys",
            )
    keys = (*GRCTL_KEYS, *SHARED_KEYS, *VERL_GR_KEYS)
    return bool(sp.enable_two_stage_rollout) or bool(_set(sp, keys))


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _prefix_ids(sp: SamplingParamsBody, verl_text: str | None, tokenizer: Any | None):
    fp = sp.forced_prefix
    if fp is not None and verl_text is not None:
        raise ValidationError(
            "forced_prefix and decode_config.item_generation.prefix_text both set; send one"
        )
    if fp is not None and (fp.text is None) == (fp.ids is None):
        raise ValidationError("forced_prefix takes one of text or ids")
    text = verl_text if fp is None else fp.text
    if text is None:
        return tuple(fp.ids or ()) if fp is not None else ()
    if tokenizer is None:
        raise ValidationError(
            "a forced prefix given as text needs a tokenizer in the model directory",
            hint='send "forced_prefix": {"ids": [...]}',
        )
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _return_mode(sp: SamplingParamsBody, default: str) -> bool:
    """True: best_only."""
    mode = sp.beam_return_mode
    if mode is None and sp.return_all_beams is not None:
        mode = "all_beams" if sp.return_all_beams else "best_only"
    return (mode or default) in ("best_only", "best")


def staged_request(
    body: GenerateBody,
    sp: SamplingParamsBody,
    items: SamplingParams,
    template: GenerateRequest,
    tokenizer: Any | None,
    reasoning_length: int = SGLANG_DEFAULT,
) -> StagedRequest:
    """`items`: sampling_of(body, sp), the item stage as a one-stage request reads it;
    `reasoning_length`: stage 1's max_new_tokens where the request leaves it out."""
    check_stage_knobs(sp)
    if body.return_original_logprob:
        raise ValidationError(
            "return_original_logprob is not served for multi-stage requests: their logprobs "
            "are the behaviour policy's"
        )
    if sp.reasoning is not None:
        verl = _set(sp, VERL_GR_KEYS)
        if verl:
            raise ValidationError(
                f"sampling_params.reasoning (grctl's spelling) and {', '.join(verl)} "
                "(verl-GR's) in one request; send one spelling"
            )
        rs = sp.reasoning
        reasoning = SamplingParams(
            max_new_tokens=_first(rs.max_new_tokens, reasoning_length),
            temperature=rs.temperature,
            top_p=rs.top_p,
            top_k=rs.top_k,
            min_p=rs.min_p,
            seed=rs.seed,
            stop_token_ids=tuple(rs.stop_token_ids or ()),
            stop=_stops(rs.stop),
            ignore_eos=rs.ignore_eos,
            min_new_tokens=rs.min_new_tokens,
            use_catalog=False,
        )
        num, best_only, prefix = (
            rs.n,
            _return_mode(sp, "all_beams"),
            _prefix_ids(sp, None, tokenizer),
        )
        group_id, index = sp.beam_group_id, sp.beam_index
        include_stop = rs.include_stop_str_in_output
    else:
        reasoning, items, prefix = _verl_gr(sp, items, tokenizer, reasoning_length)
        rc = (sp.decode_config or DecodeConfig()).reasoning or DecodePhase()
        include_stop = rc.include_stop_str_in_output is not False
        num, best_only = 1, _return_mode(sp, "best_only")
        group_id = _first(sp.beam_group_id, sp.two_stage_group_id)
        index = _first(sp.beam_index, sp.beam_idx)
    if group_id is not None and num != 1:
        raise ValidationError("beam_group_id names one group: reasoning.n must be 1 with it")
    if index is not None and group_id is None:
        raise ValidationError("beam_index needs beam_group_id (the group it indexes)")
    return StagedRequest(
        request_id=template.request_id or "",
        input_ids=template.input_ids,
        reasoning=reasoning,
        num_samples=num,
        prefix_ids=prefix,
        items=items,
        best_only=best_only,
        group_ids=(group_id,) if group_id is not None else (),
        group_index=index or 0,
        include_stop_str=include_stop,
        detokenize=template.detokenize,
        stage_template=template,
    )


def check_stage_knobs(sp: SamplingParamsBody) -> None:
    """The stage fields' float32 and range bounds, as one stage's (engine/validation.py), each
    refusal naming the field as sent (the engine's own checks name the stage's knob only)."""
    rs, bsp = sp.reasoning, sp.beam_search_params
    temperatures = [("stage2_temperature", sp.stage2_temperature)]
    top_ks = [("stage2_top_k", sp.stage2_top_k)]
    if rs is not None:
        temperatures.append(("reasoning.temperature", rs.temperature))
        top_ks.append(("reasoning.top_k", rs.top_k))
    if bsp is not None:
        temperatures.append(("beam_search_params.temperature", bsp.temperature))
        top_ks.append(("beam_search_params.top_k", bsp.top_k))
        if bsp.length_penalty is not None:
            check_length_penalty(bsp.length_penalty, "beam_search_params.length_penalty")
    for name, value in temperatures:
        if value is not None:
            check_temperature(value, name)
    for name, value in top_ks:
        if value is not None:
            check_top_k(value, name)


def _verl_gr(
    sp: SamplingParamsBody, items: SamplingParams, tokenizer: Any | None, reasoning_length: int
):
    """verl-GR's reading: the request's own temperature, top_p, top_k, min_p, seed and stop ids
    are stage 1's; decode_config and beam_search_params the rest."""
    if sp.n != 1:
        raise ValidationError(
            "sampling_params.n must be 1 in verl-GR's spelling",
            hint="beam_return_mode says how many beams return (best_only: 1, all_beams: all)",
        )
    decode = sp.decode_config or DecodeConfig()
    rc, ic = decode.reasoning or DecodePhase(), decode.item_generation or DecodePhase()
    bsp = sp.beam_search_params or BeamSearchParams()
    stop = _first(rc.stop, sp.stop)
    reasoning = SamplingParams(
        max_new_tokens=_first(
            rc.max_tokens, sp.stage1_max_tokens, sp.max_new_tokens, reasoning_length
        ),
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=items.seed,
        stop_token_ids=items.stop_token_ids,
        stop=VERL_GR_STOP if stop is None else _stops(stop),
        ignore_eos=sp.ignore_eos,
        min_new_tokens=sp.min_new_tokens,
        use_catalog=False,
    )
    prefix_text = ic.prefix_text
    if prefix_text is None and sp.forced_prefix is None:
        prefix_text = VERL_GR_PREFIX
    beams = dataclasses.replace(
        items,
        max_new_tokens=_first(
            bsp.max_tokens,
            sp.stage2_num_tokens,
            sp.stage2_max_tokens,
            ic.max_tokens,
            VERL_GR_ITEM_TOKENS,
        ),
        n=_first(sp.beam_width, sp.stage2_beam_size, VERL_GR_WIDTH),
        beam_width=None,
        temperature=_first(bsp.temperature, sp.stage2_temperature, 0.0),
        top_p=_first(bsp.top_p, sp.stage2_top_p, 1.0),
        top_k=_first(bsp.top_k, sp.stage2_top_k, -1),
        min_p=0.0,
        length_penalty=_first(bsp.length_penalty, VERL_GR_LENGTH_PENALTY),
        ignore_eos=bool(bsp.ignore_eos),
        min_new_tokens=0,
        stop_token_ids=(),
        stop=(),
    )
    return reasoning, beams, _prefix_ids(sp, prefix_text, tokenizer)
