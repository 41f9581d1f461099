"""Multi-stage bodies (docs/http-api.md "Multi-stage requests"): which sampling_params ask for
one, in grctl's spelling or verl-GR's."""

from __future__ import annotations

from grctl.protocol.generate import SamplingParamsBody

GRCTL_KEYS = ("reasoning", "forced_prefix", "beam_return_mode", "beam_group_id", "beam_index")
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


def is_multi_stage(sp: SamplingParamsBody) -> bool:
    """Any multi-stage key set (enable_two_stage_rollout false alone asks for one stage)."""
    keys = (*GRCTL_KEYS, *VERL_GR_KEYS)
    return bool(sp.enable_two_stage_rollout) or any(getattr(sp, k) is not None for k in keys)
