"""Hostile and malformed input on every route: always a 4xx in the error shape, never a 5xx,
the weights checksum unchanged, the server alive and serving the same outputs afterwards."""

from __future__ import annotations

import base64
import json
import re
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar import post
from litestar.datastructures import State

from grctl.server.offload import offload
from grctl.weights.wire.encode import MultiprocessingSerializer
from grctl.weights.wire.records import FlattenedTensorMetadata
from tests.support import hostile_pickles
from tests.support.appserver import app_server
from tests.support.checkpoints import write_checkpoint
from tests.support.memory import peak_rss, reset_peak, rss
from tests.support.stall import health_while, steady_health
from tests.support.weight_helpers import served_greedy, served_sha256

pytestmark = pytest.mark.timeout(300)

POST_ROUTES = [
    "/generate",
    "/submit",
    "/submit_many",
    "/cancel",
    "/abort_request",
    "/flush_cache",
    "/pause_generation",
    "/update_weight_version",
    "/get_weights_by_name",
    "/weights_checker",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/pull_weights",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
]
GET_ROUTES = [
    "/health",
    "/ready",
    "/status",
    "/metrics",
    "/server_info",
    "/model_info",
    "/v1/loads",
    "/loads",
    "/get_weight_version",
    "/get_weights_by_name",
    "/flush_cache",
    "/poll/x",
    "/result/x",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The fuzz root the cases name paths under (pytest's tmp dir: nothing left in /tmp)."""
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def srv(start_server, root):
    ckpt = write_checkpoint(root / "weights" / "base", seed=41)
    args = ("--model-path", str(ckpt), "--weights-root", str(root / "weights"))
    return start_server("--allow-weight-update", "--allow-catalog-reload", *args)


@pytest.fixture(scope="module")
def baseline(http):
    return served_sha256(http), served_greedy(http, [3, 4, 5])["output_ids"]


def check_4xx(resp) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert set(err) == {"code", "message", "retryable", "status"}
    assert err["status"] == resp.status_code and err["message"]


def bucket(records, nbytes=64) -> str:
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    return MultiprocessingSerializer.serialize(
        {"flattened_tensor": flat, "metadata": records}, output_str=True
    )


def rec(name="model.norm.weight", shape=(16,), start=0, end=64, dtype=torch.float32, numel=None):
    return FlattenedTensorMetadata(
        name=name,
        shape=torch.Size(shape) if all(isinstance(d, int) and d >= 0 for d in shape) else shape,
        dtype=dtype,
        start_idx=start,
        end_idx=end,
        numel=end - start if numel is None else numel,
    )


def tensor_body(entry, fmt="flattened_bucket") -> dict:
    return {"serialized_named_tensors": [entry], "load_format": fmt}


DEEP = "[" * 100_000 + "]" * 100_000
TOP_P_IDS = "return_top_p_token_ids"
DEEP_TOP_P_IDS = f'{{"input_ids": [1], "sampling_params": {{"custom_params": {{"{TOP_P_IDS}": '
DEEP_TOP_P_IDS += DEEP + "}}}"


NESTED = json.loads("[" * 500 + "]" * 500)
# every multi-stage field (docs/http-api.md "Multi-stage requests"): wrong types, huge values,
# deep nesting; beside and inside custom_params
MULTI_STAGE_BAD = [
    {"reasoning": "think"},
    {"reasoning": {"n": "two"}},
    {"reasoning": {"n": 10**30}},
    {"reasoning": {"max_new_tokens": 10**9}},
    {"reasoning": {"temperature": -1}},
    {"reasoning": {"top_p": 2}},
    {"reasoning": {"stop": [[["x"]]]}},
    {"reasoning": {"stop": "</think>"}},  # no tokenizer here
    {"reasoning": {"stop_token_ids": [10**12]}},
    {"reasoning": {"bogus": 1}},
    {"reasoning": NESTED},
    {"reasoning": {}, "forced_prefix": "abc"},
    {"reasoning": {}, "forced_prefix": {"ids": [-1]}},
    {"reasoning": {}, "forced_prefix": {"ids": [10**9]}},
    {"reasoning": {}, "forced_prefix": {"ids": [1] * 100_000}},
    {"reasoning": {}, "forced_prefix": {"text": "x" * 200_000}},
    {"reasoning": {}, "forced_prefix": {"ids": NESTED}},
    {"reasoning": {}, "n": 10**6},
    {"beam_group_id": ""},
    {"beam_group_id": 5},
    {"beam_group_id": "x" * 5000},
    {"beam_group_id": "g", "beam_index": -1},
    {"beam_group_id": "g", "beam_index": "a"},
    {"beam_group_id": "g", "beam_index": 10**30},
    {"beam_return_mode": "some"},
    {"beam_return_mode": NESTED},
    {"decode_config": "x"},
    {"decode_config": {"reasoning": {"max_tokens": -5}}},
    {"decode_config": {"item_generation": {"prefix_text": 5}}},
    {"decode_config": {"reasoning": {"stop": {"a": 1}}}},
    {"decode_config": {"item_generation": {}}},  # verl-GR's text prefix: no tokenizer
    {"decode_config": NESTED},
    {"beam_search_params": {"max_tokens": 10**20}},
    {"beam_search_params": {"temperature": "hot"}},
    {"beam_search_params": {"bogus": 1}},
    {"stage2_beam_size": 0},
    {"decode_config": {}, "forced_prefix": {"ids": [1]}, "stage2_beam_size": 10**6},
    {"decode_config": {}, "forced_prefix": {"ids": [1]}, "stage1_max_tokens": 10**12},
    {"beam_idx": -3},
    {"two_stage_group_id": ["a"]},
    {"enable_two_stage_rollout": "yes"},
    {"enable_two_stage_rollout": False, "reasoning": {}},
    {"return_all_beams": [3]},
    {"stage2_temperature": -1},
    # past float32 (and the engine's bounds): each a 400 naming the field as sent
    {"decode_config": {}, "stage2_temperature": 1e308},
    {"decode_config": {}, "stage2_top_k": 2**63},
    {"decode_config": {}, "stage2_top_p": 1e308},
    {"beam_search_params": {"temperature": 1e308}},
    {"beam_search_params": {"length_penalty": 1e308}},
    {"beam_search_params": {"length_penalty": -1e308}},
    {"beam_search_params": {"top_k": 10**30}},
    {"reasoning": {"temperature": 1e308}},
    {"reasoning": {"top_k": 2**31}},
    {"reasoning": {"min_p": 1e308}},
    {"custom_params": {"reasoning": {"n": -1}}},
    {"custom_params": {"decode_config": NESTED}},
    {"custom_params": {"beam_group_id": "x" * 5000}},
]


# the grctl fields /v1/completions takes (docs/http-api.md "Multi-stage requests")
COMPLETION_STAGE_BAD = [
    {"reasoning": "think"},
    {"reasoning": [1]},
    {"reasoning": {"n": 10**30}},
    {"reasoning": {"max_new_tokens": 10**12}},
    {"reasoning": {"temperature": 1e308}},
    {"reasoning": {"top_k": 2**63}},
    {"reasoning": {"stop_token_ids": [10**12]}},
    {"reasoning": {"bogus": 1}},
    {"reasoning": NESTED},
    {"reasoning": {}, "forced_prefix": "abc"},
    {"reasoning": {}, "forced_prefix": {"ids": [10**9]}},
    {"reasoning": {}, "forced_prefix": {"ids": NESTED}},
    {"reasoning": {}, "forced_prefix": {"text": "x" * 200_000}},
    {"reasoning": {}, "beam_return_mode": NESTED},
    {"reasoning": {}, "beam_return_mode": "some"},
    {"reasoning": {}, "n": 10**6},
    {"reasoning": {}, "max_tokens": 10**12},
    {"reasoning": {}, "temperature": 1e308},
    {"reasoning": {}, "echo": True},
    {"reasoning": {}, "logprobs": 5},
    {"forced_prefix": {"ids": [1]}},  # no reasoning
    {"beam_return_mode": "best_only"},
]


def multi_stage_cases() -> list[tuple[str, str, object]]:
    """Every bad multi-stage body on each route that takes one: /generate, /submit,
    /submit_many (beside a good row: all or none) and the OpenAI routes."""
    good = {
        "input_ids": [1, 2],
        "sampling_params": {"reasoning": {"max_new_tokens": 2}, "max_new_tokens": 1},
    }
    out: list[tuple[str, str, object]] = []
    for sp in MULTI_STAGE_BAD:
        row = {"input_ids": [1, 2], "sampling_params": sp}
        out.append(("POST", "/generate", row))
        out.append(("POST", "/submit", row))
        out.append(("POST", "/submit_many", {"requests": [good, row]}))
    for extra in COMPLETION_STAGE_BAD:
        out.append(("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, **extra}))
        if "echo" not in extra and "logprobs" not in extra:
            chat = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 1, **extra}
            out.append(("POST", "/v1/chat/completions", chat))
    return out


def cases(root: Path) -> list[tuple[str, str, object]]:
    """(method, route, body): a dict/list is sent as JSON, bytes raw, str raw UTF-8."""
    outside = root / "outside"
    c: list[tuple[str, str, object]] = [
        # JSON type confusion
        ("POST", "/generate", {"input_ids": "1,2,3"}),
        ("POST", "/generate", {"input_ids": [[1, 2], [3, 4]], "rid": ["only-one"]}),
        ("POST", "/generate", {"input_ids": [[1, 2], []]}),  # a batch with an empty prompt
        ("POST", "/generate", {"input_ids": [1.5, 2]}),
        ("POST", "/generate", {"input_ids": [True, False]}),
        ("POST", "/generate", {"input_ids": [{"a": 1}]}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": "greedy"}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"n": "many"}}),
        ("POST", "/generate", {"input_ids": [1], "return_logprob": {"x": 1}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"item_finish_reason": 1}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"item_finish_reason": "x"}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"item_prefix_len": -1}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"item_prefix_len": 2**70}}),
        ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"item_prefix_len": 1}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"n_beams": 4}}),
        ("POST", "/generate", {"input_ids": [[1], [2]], "sampling_params": [{}, {"": None}]}),
        # the behaviour-logprob options (issue 25): wrong types, huge values, a bad mode
        ("POST", "/generate", {"input_ids": [1], "return_original_logprob": "sometimes"}),
        ("POST", "/generate", {"input_ids": [1], "return_original_logprob": [True]}),
        ("POST", "/generate", {"input_ids": [1], "return_original_logprob": 10**30}),
        ("POST", "/generate", {"input_ids": [1], "return_sampling_mask": {"x": 1}}),
        ("POST", "/generate", {"input_ids": [1], "return_sampling_mask": 10**30}),
        ("POST", "/generate", {"input_ids": [1], "return_sampling_mask": -1.5}),
        ("POST", "/generate", {"input_ids": [1], "sampling_logprobs_mode": "support"}),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "return_sampling_mask": True, "sampling_logprobs_mode": 7},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "return_sampling_mask": True, "sampling_logprobs_mode": "x" * 4096},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "return_sampling_mask": True, "top_logprobs_num": 10**12},
        ),
        (
            "POST",
            "/submit",
            {"input_ids": [1], "return_original_logprob": {}, "return_sampling_mask": True},
        ),
        ("POST", "/generate", [1, 2, 3]),
        ("POST", "/generate", "null"),
        ("POST", "/submit_many", {"requests": {"input_ids": [1]}}),
        ("POST", "/pause_generation", {"mode": 3}),
        ("POST", "/pause_generation", {"mode": ["abort"]}),
        ("POST", "/update_weights_from_disk", {"model_path": 42}),
        ("POST", "/update_weights_from_disk", {"model_path": ["a"]}),
        ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": {"0": "x"}}),
        ("POST", "/update_weights_from_distributed", {"names": "a", "dtypes": [], "shapes": []}),
        ("POST", "/weights_checker", {"action": None}),
        ("POST", "/cancel", {"request_id": ["x"]}),
        # huge and negative numbers
        ("POST", "/generate", {"input_ids": [10**30]}),
        ("POST", "/generate", {"input_ids": [-1]}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**12}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -5}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"n": 10**9}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_p": 7}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_k": -9}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"seed": 2**80}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"temperature": 1e308}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_k": 2**63}}),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"n": 2, "length_penalty": 1e308}},
        ),
        ("POST", "/v1/completions", {"prompt": [1], "max_tokens": 1, "temperature": 1e308}),
        # a key named twice (msgspec kept the last one)
        ("POST", "/generate", '{"input_ids": [1], "input_ids": [2]}'),
        ("POST", "/generate", {"input_ids": [1] * 100_000}),
        # prompt scoring: a start past the prompt, a list for one prompt, a type, too many back
        (
            "POST",
            "/generate",
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "return_logprob": True, "logprob_start_len": [0, 0]},
        ),
        ("POST", "/generate", {"input_ids": [1], "return_logprob": True, "logprob_start_len": -9}),
        ("POST", "/generate", {"input_ids": [1], "logprob_start_len": {"a": 1}}),
        (
            "POST",
            "/generate",
            {
                "input_ids": [1] * 4000,
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 1000,
                "sampling_params": {"max_new_tokens": 0},
            },
        ),
        ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": -1, "echo": True}),
        ("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": -1}),
        ("POST", "/flush_cache", {"timeout": -3}),
        (
            "POST",
            "/update_weights_from_distributed",
            {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[-16]]},
        ),
        (
            "POST",
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 10**9,
                "rank_offset": 1,
                "world_size": 2,
            },
        ),
        # deep nesting and broken encodings
        ("POST", "/generate", DEEP),
        ("POST", "/update_weights_from_tensor", "{" * 50_000),
        ("POST", "/generate", b'{"input_ids": [1], "text": "\xff\xfe\xfa"}'),
        ("POST", "/generate", b"\xff\xff\xff"),
        ("POST", "/generate", '{"input_ids": [1,'),
        ("POST", "/weights_checker", "not json at all"),
        # text without a tokenizer
        ("POST", "/generate", {"text": "hello"}),
        # dtype strings that are not dtypes, names with path characters
        (
            "POST",
            "/update_weights_from_distributed",
            {"names": ["model.norm.weight"], "dtypes": ["os.system"], "shapes": [[16]]},
        ),
        (
            "POST",
            "/update_weights_from_distributed",
            {
                "names": ["model.norm.weight"],
                "dtypes": ["torch.float32; rm -rf /"],
                "shapes": [[16]],
            },
        ),
        (
            "POST",
            "/update_weights_from_distributed",
            {"names": ["../../etc/passwd"], "dtypes": ["float32"], "shapes": [[16]]},
        ),
        ("POST", "/get_weights_by_name", {"name": "../../../etc/passwd"}),
        ("POST", "/get_weights_by_name", {"name": "model.norm.weight/../../x"}),
        ("POST", "/get_weights_by_name", {"name": "__class__.__init__.__globals__"}),
        (
            "POST",
            "/update_weights_from_tensor",
            tensor_body(bucket([rec(name="../../model.norm.weight")])),
        ),
        # bucket metadata with bad offsets
        ("POST", "/update_weights_from_tensor", tensor_body(bucket([rec(start=32, end=96)]))),
        ("POST", "/update_weights_from_tensor", tensor_body(bucket([rec(start=-8, end=56)]))),
        ("POST", "/update_weights_from_tensor", tensor_body(bucket([rec(start=40, end=8)]))),
        ("POST", "/update_weights_from_tensor", tensor_body(bucket([rec(numel=999)]))),
        (
            "POST",
            "/update_weights_from_tensor",
            tensor_body(
                bucket(
                    [rec(), rec(name="model.layers.0.input_layernorm.weight", start=8, end=72)], 72
                )
            ),
        ),
        ("POST", "/update_weights_from_tensor", tensor_body(bucket([rec(shape=(2**40,))]))),
        ("POST", "/update_weights_from_tensor", tensor_body(bucket([rec(dtype="float32")]))),
        ("POST", "/update_weights_from_tensor", tensor_body("AAAA", "flattened_bucket")),
        ("POST", "/update_weights_from_tensor", tensor_body("=" * 64, None)),
        # model_path escapes through .. and symlinks, and odd paths
        (
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(root / "weights" / ".." / "outside")},
        ),
        ("POST", "/update_weights_from_disk", {"model_path": str(root / "weights" / "link")}),
        ("POST", "/update_weights_from_disk", {"model_path": "/etc"}),
        ("POST", "/update_weights_from_disk", {"model_path": str(outside)}),
        ("POST", "/update_weights_from_disk", {"model_path": str(root / "weights" / "nope")}),
        (
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(root / "weights" / "base" / "config.json")},
        ),
        ("POST", "/update_weights_from_disk", {"model_path": "weights\x00/base"}),
        ("POST", "/update_weights_from_disk", {"model_path": ""}),
        (
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(root / "weights" / "base"), "load_format": "gguf"},
        ),
        # /pull_weights (delta syncs): types, escapes, missing or foreign versions
        ("POST", "/pull_weights", {"source_dir": 42, "target_version": 1}),
        ("POST", "/pull_weights", {"source_dir": str(root / "weights"), "target_version": -1}),
        ("POST", "/pull_weights", {"source_dir": str(root / "weights"), "target_version": 2**70}),
        ("POST", "/pull_weights", {"source_dir": str(root / "weights"), "target_version": "1"}),
        ("POST", "/pull_weights", {"source_dir": "/etc", "target_version": 1}),
        (
            "POST",
            "/pull_weights",
            {"source_dir": str(root / "weights" / ".."), "target_version": 1},
        ),
        ("POST", "/pull_weights", {"source_dir": "weights\x00", "target_version": 1}),
        ("POST", "/pull_weights", {"source_dir": str(root / "weights"), "target_version": 1}),
        (
            "POST",
            "/pull_weights",
            {"source_dir": str(root / "weights" / "base"), "target_version": 0},
        ),
        (
            "POST",
            "/pull_weights",
            {"local_checkpoint_dir": "/x", "source_dir": "/y", "target_version": 0},  # 403
        ),
        ("POST", "/pull_weights", {"target_version": 1}),
        # miles' local_checkpoint_dir: types, escapes, overlaps, foreign dirs, unseeded pulls
        *[
            ("POST", "/pull_weights", {"source_dir": str(root / "weights" / "pub"), **extra})
            for extra in (
                {"local_checkpoint_dir": 7, "target_version": 0},
                {"local_checkpoint_dir": str(root / "weights" / ".." / "x"), "target_version": 0},
                {"local_checkpoint_dir": "weights\x00/l", "target_version": 0},
                {"local_checkpoint_dir": str(root / "weights"), "target_version": 0},
                {"local_checkpoint_dir": str(root / "weights" / "base"), "target_version": 0},
                {"local_checkpoint_dir": str(root / "weights" / "pub"), "target_version": 0},
                {"local_checkpoint_dir": str(root / "weights" / "l"), "target_version": 3},
                {
                    "local_checkpoint_dir": str(root / "weights" / "l"),
                    "target_version": 0,
                    "weight_version": "x",
                },  # fmt: skip
            )
        ],
        (
            "POST",
            "/pull_weights",
            {"source_dir": str(root / "weights"), "target_version": 1, "weight_version": {}},
        ),
        # grctl's sampling fields inside sampling_params.custom_params (what smg passes on)
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"custom_params": "x"}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"custom_params": [1]}}),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"custom_params": {"z": 1}}}),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"custom_params": {"custom_params": {"n": 2}}}},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"custom_params": {"beam_width": -1}}},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"custom_params": {"beam_width": 10**9}}},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"custom_params": {"max_new_tokens": 10**12}}},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"custom_params": {"exclude_item_ids": [1]}}},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"custom_params": {"exclude_item_ids": 7}}},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"custom_params": {"seed": 2**80}}},
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"custom_params": {"length_penalty": "x"}}},
        ),
        (
            "POST",
            "/generate",
            {
                "input_ids": [1],
                "sampling_params": {"custom_params": {"logits_processors": [{"type": "exec"}]}},
            },
        ),
        (
            "POST",
            "/generate",
            {
                "input_ids": [1],
                "sampling_params": {"n": 2, "beam_width": 2, "custom_params": {"beam_width": 4}},
            },
        ),
        (
            "POST",
            "/generate",
            {
                "input_ids": [[1], [2]],
                "sampling_params": [{}, {"custom_params": {"frequency_penalty": 1}}],
            },
        ),
        # slime's custom_params.return_top_p_token_ids: a bool, nothing else
        *(
            (
                "POST",
                "/generate",
                {"input_ids": [1], "sampling_params": {"custom_params": {TOP_P_IDS: bad}}},
            )
            for bad in ("true", 1, None, [True], {"x": True}, 10**30)
        ),
        ("POST", "/generate", DEEP_TOP_P_IDS),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {TOP_P_IDS: True}}),
        (
            "POST",
            "/submit",
            {"input_ids": [1], "sampling_params": {"custom_params": {TOP_P_IDS: True, "z": 1}}},
        ),
        ("POST", "/submit", {"input_ids": [1], "sampling_params": {"custom_params": {"q": 0}}}),
        (
            "POST",
            "/submit_many",
            {"requests": [{"input_ids": [1], "sampling_params": {"custom_params": [None]}}]},
        ),
        # /loads queries
        ("GET", "/loads?include=bogus", None),
        ("GET", "/v1/loads?include=core,,memory", None),
        ("GET", "/loads?include=../../etc", None),
        ("GET", "/loads?format=xml", None),
        ("GET", "/v1/loads?format=", None),
        ("GET", "/loads?dp_rank=abc", None),
        ("GET", "/loads?dp_rank=1.5", None),
        # catalog_path on every update and on a session: types, escapes, bad files (the whole
        # sync refused, the weights untouched, no session left open)
        *catalog_cases(root),
        # unknown routes and methods
        *multi_stage_cases(),
        ("DELETE", "/generate", None),
        ("GET", "/update_weights_from_disk", None),
        ("POST", "/../../etc/passwd", {}),
        ("GET", "/result/" + "x" * 5000, None),
    ]
    for name in sorted(hostile_pickles.HOSTILE):
        raw = hostile_pickles.HOSTILE[name](root / f"marker-{name}")
        c.append(
            ("POST", "/update_weights_from_tensor", tensor_body(base64.b64encode(raw).decode()))
        )
    # stalls (shared and deep nesting, colliding keys), growth (a memo index far ahead), BUILD
    # on allowlisted objects, records made without their checks: docs/security.md
    for name in sorted(hostile_pickles.BOUNDS):
        entry = base64.b64encode(hostile_pickles.BOUNDS[name]).decode()
        c.append(("POST", "/update_weights_from_tensor", tensor_body(entry, None)))
    return c


def catalog_cases(root: Path) -> list[tuple[str, str, object]]:
    base, weights = str(root / "weights" / "base"), root / "weights"
    paths: list[object] = [
        42,
        ["a.jsonl"],
        "",
        "items\x00.jsonl",
        "/etc/passwd",
        str(root / "outside" / "items.jsonl"),
        str(weights / ".." / "outside" / "items.jsonl"),
        str(weights / "nope.jsonl"),
        str(weights),  # a directory
        str(weights / "bad-token.jsonl"),  # a token past the vocabulary
        str(weights / "not-json.jsonl"),
    ]
    c: list[tuple[str, str, object]] = []
    for path in paths:
        c.append(("POST", "/update_weights_from_disk", {"model_path": base, "catalog_path": path}))
        c.append(("POST", "/begin_weight_update", {"catalog_path": path}))
    for path in (42, str(weights / "bad-token.jsonl")):
        body = {**tensor_body(bucket([rec()])), "catalog_path": path}
        c.append(("POST", "/update_weights_from_tensor", body))
    body = {"names": [], "dtypes": [], "shapes": [], "catalog_path": {"x": 1}}
    c.append(("POST", "/update_weights_from_distributed", body))
    # /catalog/rollback's force: wrong types, a huge number, a misspelt field (never a rollback)
    for rollback in ({"force": [True]}, {"force": {"a": 1}}, {"force": 10**30}, {"forse": True}):
        c.append(("POST", "/catalog/rollback", rollback))
    return c


# Collection needs only how many cases there are (building them writes a helper module, so
# in a directory removed at once); `prepared` builds them again under the real root.
with tempfile.TemporaryDirectory(prefix="grctl-fuzz-count-") as _tmp:
    NUM_CASES = len(cases(Path(_tmp)))


@pytest.fixture(scope="module")
def prepared(root, srv):
    (root / "outside").mkdir(exist_ok=True)
    write_checkpoint(root / "outside" / "ckpt", seed=3)
    link = root / "weights" / "link"
    if not link.exists():
        link.symlink_to(root / "outside" / "ckpt")
    (root / "outside" / "items.jsonl").write_text('{"item_id": 1, "token_ids": [20, 40]}\n')
    (root / "weights" / "bad-token.jsonl").write_text('{"item_id": 1, "token_ids": [10000]}\n')
    (root / "weights" / "not-json.jsonl").write_text("{item_id: 1,\n")
    built = cases(root)
    assert len(built) == NUM_CASES
    return built


def send(http, method: str, route: str, body: object):
    if body is None:
        return http.request(method, route)
    if isinstance(body, (dict, list)):
        return http.request(method, route, json=body)
    raw = body.encode() if isinstance(body, str) else body
    return http.request(method, route, content=raw, headers={"content-type": "application/json"})


def test_at_least_fifty_cases(prepared):
    assert len(prepared) >= 50


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_hostile_input_is_a_4xx_and_changes_nothing(http, prepared, baseline, root, index):
    method, route, body = prepared[index]
    check_4xx(send(http, method, route, body))
    assert http.get("/health").status_code == 200
    assert not list(root.glob("marker-*")), "a hostile payload ran"
    if route.startswith("/update_weights") or index % 10 == 0:
        assert served_sha256(http) == baseline[0]


def test_oversize_headers_are_refused_and_server_lives(srv, http, baseline):
    for route in (b"/health", b"/status", b"/generate"):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(
                b"GET " + route + b" HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
            )
            reply = s.recv(200)
        assert reply.startswith(b"HTTP/1.1 4") or reply == b"", reply
    assert http.get("/health").status_code == 200
    assert served_greedy(http, [3, 4, 5])["output_ids"] == baseline[1]


@pytest.mark.parametrize("timeout", ["1e10", "inf"])
def test_huge_timeouts_are_never_a_500(http, baseline, timeout):
    """With a request holding its KV (paused in place), a flush is refused at once, and a
    result is not ready: neither may turn a huge timeout into a 500 (OverflowError before)."""
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 64, "n": 8}}
    submitted = http.post("/submit", json=body)
    assert submitted.status_code == 202, submitted.text[:300]
    rid = submitted.json()["request_id"]
    http.post("/pause_generation", json={"mode": "in_place"})
    try:
        flush = http.get(f"/flush_cache?timeout={timeout}", timeout=5)
        assert flush.status_code < 500, flush.text[:300]
    finally:
        http.post("/continue_generation")
    result = http.get(f"/result/{rid}?timeout={timeout}", timeout=60)
    assert result.status_code == 200, result.text[:300]
    assert http.get("/health").status_code == 200
    assert served_sha256(http) == baseline[0]


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "input_ids",
    "sampling_params",
    "prompt",
    "reasoning",
    "forced_prefix",
    "beam_return_mode",
    "n",
    "max_new_tokens",
    "mode",
    "model_path",
    "name",
    "truncate_size",
    "serialized_named_tensors",
    "load_format",
    "weight_version",
    "names",
    "dtypes",
    "shapes",
    "action",
    "timeout",
    "requests",
    "rid",
    "abort_all",
    "new_version",
    "logprob_start_len",
    "top_logprobs_num",
    "return_logprob",
    "return_original_logprob",
    "return_sampling_mask",
    "sampling_logprobs_mode",
]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(POST_ROUTES),
    body=st.dictionaries(st.sampled_from(FIELDS), JSONISH, max_size=5),
)
def test_random_bodies_never_5xx(http, route, body):
    if route in ("/pause_generation", "/update_weight_version", "/weights_checker"):
        body = {k: v for k, v in body.items() if k not in ("mode", "action", "new_version")}
    if route == "/update_weights_from_disk":  # stay inside the fuzz root's nonexistent paths
        body["model_path"] = "/nonexistent/fuzz"
    try:
        resp = http.post(
            route,
            content=json.dumps(body, allow_nan=True),
            headers={"content-type": "application/json"},
        )
    finally:
        http.post("/continue_generation")
    assert resp.status_code < 500, (route, body, resp.text[:300])


CUSTOM_KEYS = [
    "beam_width",
    "use_catalog",
    "exclude_item_ids",
    "length_penalty",
    "seed",
    "temperature",
    "logits_processors",
    "stop_token_ids",
    "custom_params",
    "frequency_penalty",
    "reasoning",
    "forced_prefix",
    "beam_group_id",
    "beam_index",
    "beam_return_mode",
    "decode_config",
    "beam_search_params",
    TOP_P_IDS,
    "bogus",
]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    custom=JSONISH | st.dictionaries(st.sampled_from(CUSTOM_KEYS), JSONISH, max_size=4),
    beside=st.dictionaries(st.sampled_from(CUSTOM_KEYS[:6]), JSONISH, max_size=2),
)
def test_random_custom_params_never_5xx(http, custom, beside):
    sp = {**beside, "max_new_tokens": 2, "custom_params": custom}
    body = {"input_ids": [3, 4, 5], "sampling_params": sp}
    resp = http.post(
        "/generate",
        content=json.dumps(body, allow_nan=True),
        headers={"content-type": "application/json"},
    )
    assert resp.status_code < 500, (body, resp.text[:300])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    query=st.dictionaries(
        st.sampled_from(["include", "format", "dp_rank", "model"]), st.text(max_size=30)
    )
)
def test_random_loads_queries_never_5xx(http, query):
    for route in ("/loads", "/v1/loads"):
        resp = http.get(route, params=query)
        assert resp.status_code < 500, (route, query, resp.text[:300])
        if resp.status_code >= 400:
            check_4xx(resp)


def test_still_serving_the_same_model(http, baseline):
    http.post("/continue_generation")
    assert served_sha256(http) == baseline[0]
    assert served_greedy(http, [3, 4, 5])["output_ids"] == baseline[1]


# ---- the guard: every route of the app's own table is attacked, and none stalls the loop ----
#
# The routes come from Litestar's route table, so a route added tomorrow is attacked by the
# generated cases below (wrong types, huge numbers, deep nesting, huge strings, from its body
# Struct's fields and its query and path parameters) and must name its worst accepted input in
# WORST, which the stall probe runs while /health must keep answering within 100 ms: CPU work a
# handler does on the event loop (tokenizing, templating, parsing ids, building large replies)
# instead of through server/offload.py fails it (test_the_probe_fails_a_route_on_the_loop).

IGNORED_PARAMS = {"state", "request", "scope", "data", "headers", "socket"}
HUGE_STR = "x" * 200_000
HUGE_INT = 10**30


def route_table(app) -> list[tuple[str, str, object]]:
    """(method, path template, handler) of every route the app serves (HEAD/OPTIONS aside)."""
    out = []
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            for method in sorted(handler.http_methods - {"HEAD", "OPTIONS"}):
                out.append((method, route.path, handler))
    return out


def body_type(handler):
    """The msgspec Struct a handler decodes its body into, or None."""
    data = handler.parsed_fn_signature.parameters.get("data")
    if data is None:
        return None
    kinds = [a for a in getattr(data.annotation, "__args__", (data.annotation,)) if a is not None]
    structs = [k for k in kinds if isinstance(k, type) and issubclass(k, msgspec.Struct)]
    return structs[0] if structs else None


def rejected(kind, body) -> bool:
    """Whether the Struct itself refuses this body (then the route must answer 4xx)."""
    try:
        msgspec.json.decode(msgspec.json.encode(body), type=kind, strict=False)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return True
    return False


def concrete(template: str, value: str = "x") -> str:
    return re.sub(r"\{[^}]+\}", value, template)


def generated_cases(method: str, template: str, handler) -> list[tuple[str, str, object, bool]]:
    """(kind, path, body or query, must be a 4xx) for one route."""
    params = handler.parsed_fn_signature.parameters
    path_params = re.findall(r"\{(\w+)", template)
    query = [p for p in params if p not in IGNORED_PARAMS and p not in path_params]
    cases: list[tuple[str, str, object, bool]] = []
    if path_params:
        cases.append(("huge_string", concrete(template, "y" * 5000), None, True))
    path = concrete(template)
    for name in query:
        cases.append(("huge_string", path, {"query": {name: HUGE_STR[:5000]}}, False))
        cases.append(("huge_number", path, {"query": {name: "1e400"}}, False))
        cases.append(("wrong_type", path, {"query": {name: "[{}]"}}, False))
    if method == "GET":
        return cases
    kind = body_type(handler)
    strict = kind is not None  # the body is a Struct: anything it refuses must be a 4xx
    cases += [
        ("wrong_type", path, [1, 2, 3], strict),
        ("wrong_type", path, "7", strict),
        ("deep_nesting", path, DEEP, strict),
        ("huge_string", path, json.dumps(HUGE_STR), strict),
    ]
    for field in msgspec.structs.fields(kind) if kind is not None else ():
        for case, value in (
            ("wrong_type", {"$": [[{"a": None}]]}),
            ("wrong_type", [[[True]]]),
            ("huge_number", HUGE_INT),
            ("huge_number", -HUGE_INT),
            ("huge_string", HUGE_STR),
            ("deep_nesting", json.loads("[" * 500 + "]" * 500)),
        ):
            body = {field.name: value}
            cases.append((case, path, body, rejected(kind, body)))
    return cases


@pytest.fixture(scope="module")
def table(root):
    """The route table of the app `grctl serve` builds (in process: only its routes are read)."""
    with app_server("--allow-weight-update", "--allow-catalog-reload") as app:
        return route_table(app.app)


def refused_whole(handler) -> bool:
    """server/routes/unsupported.py's routes: SGLang's, for transports grctl does not have."""
    return handler.fn.__module__ == "grctl.server.routes.unsupported"


def reset_state(http) -> None:
    """What an accepted case may have left on: undone before the next route's cases."""
    for route in ("/continue_generation", "/resume_memory_occupation", "/stop_profile"):
        http.post(route, json={})
    http.post("/end_weight_update", json={})
    http.post("/abort_request", json={"abort_all": True})


@pytest.mark.slow  # about 30 s: some 700 cases over every route
def test_every_route_in_the_table_is_attacked(srv, http, baseline, table):
    """Each generated case: never a 5xx, a 4xx in the error shape (a 4xx wherever the route's
    body Struct refuses it), the server alive and the weights unchanged after each route."""
    failures, seen = [], {}
    for method, template, handler in table:
        kinds = set()
        for kind, path, body, must_4xx in generated_cases(method, template, handler):
            kinds.add(kind)
            if isinstance(body, dict) and "query" in body:
                resp = http.request(method, path, params=body["query"])
            else:
                resp = send(http, method, path, body)
            if resp.status_code == 501 and refused_whole(handler):
                continue  # SGLang's routes grctl does not serve: 501 for any body
            bad = resp.status_code >= 500 or (must_4xx and not 400 <= resp.status_code < 500)
            if 400 <= resp.status_code < 500 and resp.headers.get("content-type", "").startswith(
                "application/json"
            ):
                err = resp.json().get("error") if isinstance(resp.json(), dict) else None
                bad = bad or not (err and set(err) == {"code", "message", "retryable", "status"})
            if bad:
                shown = str(body)[:80]
                failures.append(f"{method} {template} [{kind}] {shown}: {resp.status_code}")
        seen[(method, template)] = kinds
        reset_state(http)
        assert http.get("/health").status_code == 200, (method, template)
    assert served_sha256(http) == baseline[0]
    assert not failures, "\n".join(failures[:40])
    for (method, template), kinds in seen.items():  # every body route got every kind
        want = {"wrong_type", "deep_nesting", "huge_string"} if method != "GET" else set()
        assert want <= kinds, (method, template, kinds)


# ---- the stall probe: each route's worst accepted input, /health within 100 ms meanwhile ----

STALL_LIMIT_S = 0.1
WORDS = " ".join(f"t{3 + i % 120}" for i in range(400))  # 400 tokens of the word tokenizer
CHAT_TEMPLATE = (
    "{% for m in messages %}{% for w in m['content'].split(' ') %}{{ w }} {% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}t1{% endif %}"
)
NUM_ITEMS = 50_000
BIG_ITEMS = 2_000_000  # the catalog a reload's worst input loads (~100 MB of JSONL)


MiB = 2**20
PROBE_KV_BYTES = 64 * MiB  # --max-kv-bytes of the probe's server
PROBE_RESULT_BYTES = 64 * MiB  # --max-finished-result-bytes
# what one route's worst input may grow the server's peak resident memory by: its budgets, and
# room for the reply built from a result (a route holding memory past its bounds fails)
MEMORY_LIMIT = PROBE_KV_BYTES + PROBE_RESULT_BYTES + 128 * MiB


@pytest.fixture(scope="module")
def probe_root(tmp_path_factory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("probe")
    ckpt = write_checkpoint(root / "weights" / "base", seed=41)
    from tests.support.checkpoints import write_word_tokenizer

    write_word_tokenizer(ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    lines = (
        json.dumps({"item_id": i, "token_ids": [3 + i % 100, 3 + i // 100 % 100, 3 + i // 10**4]})
        for i in range(NUM_ITEMS)
    )
    (root / "weights" / "items.jsonl").write_text("\n".join(lines) + "\n")
    with open(root / "weights" / "items2m.jsonl", "w") as f:  # 4 tokens: 2M distinct paths
        for start in range(0, BIG_ITEMS, 100_000):
            f.writelines(
                f'{{"item_id": {i}, "token_ids": [{3 + i % 100}, {3 + i // 100 % 100}, '
                f"{3 + i // 10**4 % 100}, {3 + i // 10**6}]}}\n"
                for i in range(start, start + 100_000)
            )
    with open(root / "weights" / "zeros.jsonl", "wb") as f:  # 1 GB of zeros, sparse
        f.truncate(10**9)
    yield root
    for name in ("items2m.jsonl", "zeros.jsonl"):  # pytest keeps its last temp dirs
        (root / "weights" / name).unlink()


@pytest.fixture(scope="module")
def probe(start_server, probe_root):
    """A server with everything a route may work on: a tokenizer and chat template, a
    50,000-item catalog, weight, catalog and profile routes on, and a host copy of the weights
    (the /resume_memory_occupation case releases them first: without a copy every later route
    would answer 503 weights_discarded)."""
    w = probe_root / "weights"
    return start_server(
        *("--model-path", str(w / "base"), "--weights-root", str(w)),
        *("--catalog", str(w / "items.jsonl"), "--allow-catalog-reload"),
        *("--allow-weight-update", "--torch-profiler-dir", str(probe_root / "traces")),
        "--enable-weights-cpu-backup",
        *("--max-kv-bytes", str(PROBE_KV_BYTES)),
        *("--max-finished-result-bytes", str(PROBE_RESULT_BYTES)),
    )


def submitted(http, **extra) -> str:
    """A finished request with a large reply (64 beams, their top logprobs), not yet fetched."""
    sp = {"n": 64, "max_new_tokens": 3, "use_catalog": False}
    body = {"text": WORDS, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 20}
    rid = http.post("/submit", json={**body, **extra}).json()["request_id"]
    while not http.get(f"/poll/{rid}").json()["ready"]:
        time.sleep(0.05)
    return rid


def full_bucket(root: Path, keep: list) -> dict:
    from tests.support.trainer_side import hf_state, tensor_entry

    entry = tensor_entry(hf_state(root / "weights" / "base"), keep)
    return {"serialized_named_tensors": [entry], "load_format": "flattened_bucket"}


# "METHOD[|METHOD] template" -> (setup(http, root, keep) -> (method, path, kwargs), accepted):
# the worst input each route accepts here; accepted False where the worst one this test can run
# is a refusal (no peer to join, SGLang's routes grctl answers 501).
def _w(method, path, accepted=True, setup=None, **kw):
    return (
        lambda http, root, keep: (method, path, kw) if setup is None else setup(http, root, keep)
    ), accepted


def _generate_batch(http, root, keep):
    return (
        "POST",
        "/generate",
        {"json": {"text": [WORDS] * 96, "sampling_params": {"max_new_tokens": 1}}},
    )


def _submit_excluding(http, root, keep):
    sp = {"max_new_tokens": 1, "exclude_item_ids": list(range(NUM_ITEMS))}
    return "POST", "/submit", {"json": {"text": WORDS, "sampling_params": sp}}


def _submit_many(http, root, keep):
    sp = {"max_new_tokens": 1, "exclude_item_ids": list(range(0, NUM_ITEMS, 20))}
    rows = [{"text": WORDS, "sampling_params": sp} for _ in range(32)]
    return "POST", "/submit_many", {"json": {"requests": rows}}


def _poll(http, root, keep):
    return "GET", f"/poll/{submitted(http)}", {}


def _result(http, root, keep):
    return "GET", f"/result/{submitted(http)}", {}


def _cancel(http, root, keep):
    rid = http.post("/submit", json={"input_ids": [1] * 300}).json()["request_id"]
    return "POST", "/cancel", {"json": {"request_id": rid}}


def _tensor(http, root, keep):
    return "POST", "/update_weights_from_tensor", {"json": full_bucket(root, keep)}


def _big_reload(http, root, keep):
    """Issue 32.5: a 2M-item catalog (its decode held the GIL for 1.2-2.1 s)."""
    return "POST", "/catalog/reload", {"json": {"path": str(root / "weights" / "items2m.jsonl")}}


def _big_session(http, root, keep):
    """Issue 32.5: a session that carries the 2M-item catalog, built at its begin (1 s of
    held GIL); a session a try before left open is closed first."""
    http.post("/end_weight_update", json={})
    path = str(root / "weights" / "items2m.jsonl")
    return "POST", "/begin_weight_update", {"json": {"catalog_path": path}}


def restore_catalog(http, root: Path) -> None:
    """The probe's 50,000-item catalog served again, after a case that installed another."""
    if http.get("/catalog/status").json()["num_items"] != NUM_ITEMS:
        reply = http.post("/catalog/reload", json={"path": str(root / "weights" / "items.jsonl")})
        assert reply.status_code == 200, reply.text


def _end_session(http, root, keep):
    http.post("/begin_weight_update", json={})
    return "POST", "/end_weight_update", {"json": {}}


def _resume(http, root, keep):
    http.post("/release_memory_occupation", json={})
    return "POST", "/resume_memory_occupation", {"json": {}}


def _rollback(http, root, keep):
    http.post("/catalog/reload", json={"path": str(root / "weights" / "items.jsonl")})
    return "POST", "/catalog/rollback", {"json": {}}


def serve_base(http, root: Path) -> Path:
    """The base checkpoint served again, labelled 0 (the routes before may have released or
    replaced the weights)."""
    http.post("/resume_memory_occupation", json={})
    base = root / "weights" / "base"
    reply = http.post("/update_weights_from_disk", json={"model_path": str(base)})
    assert reply.status_code == 200, reply.text
    http.post("/update_weight_version", json={"new_version": "0"})
    return base


def _pull_delta(http, root, keep):
    """A delta that moves every element of every tensor, against the weights served now (the
    base checkpoint, relabelled 0): applied, not refused."""
    from safetensors.torch import load_file

    from grctl.client.delta import DeltaPublisher

    base = serve_base(http, root)
    state = load_file(str(base / "model.safetensors"))
    pub_dir = Path(tempfile.mkdtemp(dir=root / "weights", prefix="pub"))  # under the root
    pub = DeltaPublisher(pub_dir, encoding="xor")
    pub.snapshot(state, version=0)
    g = torch.Generator().manual_seed(5)
    stats = pub.publish({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()})
    assert stats.changed_tensors == len(state)
    body = {"source_dir": str(pub_dir), "target_version": stats.version}
    return "POST", "/pull_weights", {"json": body}


def _sampling_mask(http, root, keep):
    """Point 1 of issue 32: every sampled token's support, 8 prompts of 32 beams x 64 tokens."""
    serve_base(http, root)
    sp = {"n": 32, "max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True}
    body = {"input_ids": [[3 + i for i in range(20)]] * 8, "sampling_params": sp}
    return "POST", "/generate", {"json": {**body, "return_sampling_mask": True}}


def _unfetched_scoring(http, root, keep):
    """Point 2 of issue 32: 40 prompt-scoring results, each ~9 MB of Python objects (500
    tokens x the top 128), submitted and never fetched (the action waits for them through
    /status, never building a reply): ~350 MB if nothing bounds them by bytes."""
    serve_base(http, root)
    done = http.get("/status").json()["scheduler"]["finished"]

    def run(client):
        for i in range(40):
            ids = [3 + (i + t) % 100 for t in range(500)]
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
            extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 128}
            reply = client.post("/submit", json={**body, **extra})
            assert reply.status_code == 202, reply.text
        while client.get("/status").json()["scheduler"]["finished"] < done + 40:
            time.sleep(0.05)
        return client.get("/status")

    return run


def _stop_profile(http, root, keep):
    http.post("/start_profile", json={"num_steps": 50})
    http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}})
    return "POST", "/stop_profile", {"json": {}}


CHAT = [{"role": "user", "content": WORDS[:40]} for _ in range(40)]  # 400 tokens in all
WORST = {
    "POST /generate": _w(None, None, setup=_generate_batch),
    "POST /submit": _w(None, None, setup=_submit_excluding),
    "POST /submit_many": _w(None, None, setup=_submit_many),
    "GET /poll/{request_id:str}": _w(None, None, setup=_poll),
    "GET /result/{request_id:str}": _w(None, None, setup=_result),
    "POST /cancel": _w(None, None, setup=_cancel),
    "POST /abort_request": _w("POST", "/abort_request", json={"abort_all": True}),
    "GET /health": _w("GET", "/health"),
    "GET /ready": _w("GET", "/ready"),
    "GET /status": _w("GET", "/status"),
    "GET /metrics": _w("GET", "/metrics"),
    "GET /get_server_info": _w("GET", "/get_server_info"),
    "GET /server_info": _w("GET", "/server_info"),
    "GET /parallelism_config": _w("GET", "/parallelism_config", params={"rank": 0}),
    "GET /model_info": _w("GET", "/model_info"),
    "GET /get_model_info": _w("GET", "/get_model_info"),
    "GET /health_generate": _w("GET", "/health_generate"),
    "POST /flush_cache": _w("POST", "/flush_cache", json={}),
    "GET /flush_cache": _w("GET", "/flush_cache"),
    "GET /v1/loads": _w("GET", "/v1/loads", params={"include": "all"}),
    "GET /loads": _w("GET", "/loads", params={"include": "all"}),
    "POST /pause_generation": _w("POST", "/pause_generation", json={"mode": "abort"}),
    "POST /continue_generation": _w("POST", "/continue_generation", json={}),
    "GET /get_weight_version": _w("GET", "/get_weight_version"),
    "POST /update_weight_version": _w("POST", "/update_weight_version", json={"new_version": "p"}),
    "GET|POST /get_weights_by_name": _w(
        "POST",
        "/get_weights_by_name",
        json={"name": "model.embed_tokens.weight", "truncate_size": 10**6},
    ),
    "POST /begin_weight_update": _w(None, None, setup=_big_session),
    "POST /end_weight_update": _w(None, None, setup=_end_session),
    "GET|POST /weights_checker": _w("POST", "/weights_checker", json={"action": "checksum"}),
    "POST /update_weights_from_disk": _w(
        None,
        None,
        setup=lambda http, root, keep: (
            "POST",
            "/update_weights_from_disk",
            {"json": {"model_path": str(root / "weights" / "base")}},
        ),
    ),
    "POST /update_weights_from_tensor": _w(None, None, setup=_tensor),
    "POST /pull_weights": _w(None, None, setup=_pull_delta),
    "POST /init_weights_update_group": _w(
        "POST", "/init_weights_update_group", accepted=False, json={"world_size": 1}
    ),
    "POST /update_weights_from_distributed": _w(
        "POST",
        "/update_weights_from_distributed",
        accepted=False,
        json={"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[16]]},
    ),
    "POST /destroy_weights_update_group": _w(
        "POST", "/destroy_weights_update_group", accepted=False, json={}
    ),
    "GET|POST /release_memory_occupation": _w("POST", "/release_memory_occupation", json={}),
    "GET|POST /resume_memory_occupation": _w(None, None, setup=_resume),
    "GET /catalog/status": _w("GET", "/catalog/status"),
    "POST /catalog/reload": _w(None, None, setup=_big_reload),
    "POST /catalog/rollback": _w(None, None, setup=_rollback),
    "GET /v1/models": _w("GET", "/v1/models"),
    "GET /v1/models/{model:path}": _w("GET", "/v1/models/x", accepted=False),
    "POST /v1/completions": _w(
        "POST", "/v1/completions", json={"prompt": [WORDS] * 96, "max_tokens": 1, "logprobs": 5}
    ),
    "POST /v1/chat/completions": _w(
        "POST",
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 20, "n": 8},
    ),
    "GET|POST /start_profile": _w("POST", "/start_profile", json={}),
    "GET|POST /stop_profile": _w(None, None, setup=_stop_profile),
    "GET /docs/assets/{file_path:path}": _w("GET", "/docs/assets/swagger-ui-bundle.js"),
    "GET /docs": _w("GET", "/docs"),
    "GET /": _w("GET", "/"),
    "GET /schema/openapi.json": _w("GET", "/schema/openapi.json"),
    "GET /openapi.json": _w("GET", "/openapi.json"),
    "GET /oauth2-redirect.html": _w("GET", "/oauth2-redirect.html"),
}


# Beside each route's worst input, the worst of what a route's bodies can make it hold (memory):
# run by the same probe, under the same stall and memory limits.
MEMORY_WORST = {
    "POST /generate (return_sampling_mask)": _w(None, None, setup=_sampling_mask),
    "POST /submit (unfetched prompt scoring)": _w(None, None, setup=_unfetched_scoring),
    # issue 32.5: it took 19 s and +2.9 GiB to refuse, reading and copying all of it
    "POST /catalog/reload (1 GB of zeros)": _w(
        None,
        None,
        accepted=False,
        setup=lambda http, root, keep: (
            "POST",
            "/catalog/reload",
            {"json": {"path": str(root / "weights" / "zeros.jsonl")}},
        ),
    ),
}

# A catalog build holds the file's rows and the trie's sort at once (~4.3x the 100 MB file;
# it keeps ~0.6x): those cases' memory bound, in place of MEMORY_LIMIT.
BIG_CATALOG_LIMIT = 6 * 100 * MiB
MEMORY_LIMIT_OF = {
    "POST /catalog/reload": BIG_CATALOG_LIMIT,
    "POST /begin_weight_update": BIG_CATALOG_LIMIT,
}


# Stalls the probe finds and nobody has fixed yet (issue 32.5): left out of the probe's stall
# assertion (their memory and refusals still checked), each held by the xfail test below.
KNOWN_STALLS = {
    # torch's stop post-processes every recorded event on the engine's thread, holding the
    # GIL (engine/profiler.py); the export after it is off the engine's thread
    "GET /stop_profile": "torch's stop holds the GIL (65 ms here at load 1, seconds if long)",
}


def worst_of(method: str, template: str, handler):
    """The route's WORST entry; SGLang's routes grctl refuses share one (any body: a 501)."""
    for key, entry in WORST.items():
        methods, path = key.split(" ", 1)
        if path == template and method in methods.split("|"):
            return entry
    if refused_whole(handler):
        return _w(method, template, accepted=False, json={"x": HUGE_STR})
    return None


def test_every_route_names_its_worst_input(table):
    missing = sorted({f"{m} {t}" for m, t, h in table if worst_of(m, t, h) is None})
    assert not missing, f"add these routes' worst accepted input to WORST: {missing}"


@pytest.mark.slow  # about 150 s: every route's worst input, one after another
def test_no_route_stalls_the_event_loop(probe, probe_root, table):
    """While each route's worst accepted input runs, and for TAIL_S after its reply (work its
    worker goes on with), /health answers within 100 ms (a probe over it is run twice more and
    the median kept: a loaded machine may delay one poll, a stalling route stalls each time);
    and the server's peak resident memory grows by at most MEMORY_LIMIT (its budgets; a big
    catalog's build, MEMORY_LIMIT_OF)."""
    stalls, refused, grown = [], [], []
    handled = set()
    pid = probe.proc.pid
    entries = []
    for method, template, handler in table:
        entry = worst_of(method, template, handler)
        if id(entry) not in handled and entry is not None:
            handled.add(id(entry))
            entries.append((f"{method} {template}", entry))
    entries += list(MEMORY_WORST.items())
    with probe.client(timeout=120) as http:
        for name, (make, accepted) in entries:
            keep: list = []

            def action(client, make=make, keep=keep):
                made = make(client, probe_root, keep)
                if callable(made):
                    return made(client)
                m, path, kw = made
                return client.request(m, path, **kw)

            before = rss(pid)
            reset_peak(pid)
            worst, replies = steady_health(
                lambda: probe.client(timeout=120), action, limit_s=STALL_LIMIT_S
            )
            peak = peak_rss(pid) - before
            code = replies[-1].status_code
            if accepted and code >= 400 or not accepted and code < 400:
                refused.append(f"{name}: {code} {replies[-1].text[:120]}")
            if worst >= STALL_LIMIT_S and name not in KNOWN_STALLS:
                stalls.append(f"{name}: /health took {worst * 1000:.0f} ms")
            if peak > MEMORY_LIMIT_OF.get(name, MEMORY_LIMIT):
                grown.append(f"{name}: peak RSS +{peak / MiB:.0f} MiB")
            reset_state(http)
            serve_base(http, probe_root)  # a release may have discarded them
            restore_catalog(http, probe_root)
            keep.clear()
    assert not refused, "\n".join(refused)
    assert not stalls, "\n".join(stalls)
    assert not grown, "\n".join(grown)


@pytest.mark.slow
@pytest.mark.xfail(reason="issue 32.5, open: " + "; ".join(KNOWN_STALLS.values()), strict=False)
def test_known_stalls_are_fixed(probe, probe_root, table):
    entries = {f"{m} {t}": worst_of(m, t, h) for m, t, h in table} | MEMORY_WORST
    with probe.client(timeout=120) as http:
        for name in KNOWN_STALLS:
            make, _ = entries[name]

            def action(client, make=make):
                made = make(client, probe_root, [])
                return (
                    made(client) if callable(made) else client.request(made[0], made[1], **made[2])
                )

            worst, _ = steady_health(lambda: probe.client(timeout=120), action, STALL_LIMIT_S)
            reset_state(http)
            serve_base(http, probe_root)
            restore_catalog(http, probe_root)
            assert worst < STALL_LIMIT_S, f"{name}: /health took {worst * 1000:.0f} ms"


def _staged_generate(c, sp):
    body = {"text": [WORDS] * 16, "sampling_params": sp, "return_logprob": True}
    replies = c.post("/generate", json=body)
    assert replies.status_code == 200, replies.text[:300]
    return len(replies.json())  # prompts answered


def _staged_submit_many(c, sp):
    rows = [{"text": WORDS, "sampling_params": sp, "return_logprob": True}] * 16
    queued = c.post("/submit_many", json={"requests": rows})
    assert queued.status_code == 202, queued.text[:300]
    out = []
    for rid in queued.json()["request_ids"]:
        reply = c.get(f"/result/{rid}", params={"timeout": 120})
        assert reply.status_code == 200, reply.text[:300]
        out.append(reply.json())
    return len(out)


def _staged_completions(c, sp):
    body = {
        "prompt": [WORDS] * 16,
        "reasoning": sp["reasoning"],
        "forced_prefix": sp["forced_prefix"],
        "n": sp["n"],
        "max_tokens": sp["max_new_tokens"],
        "temperature": 0.0,
        "logprobs": 0,
    }
    reply = c.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text[:300]
    choices = reply.json()["choices"]
    assert len(choices) == 16 * 4 * 16  # every beam of every sample of every prompt
    return len({c["meta_info"]["request_id"] for c in choices})


@pytest.mark.slow
@pytest.mark.parametrize("run", [_staged_generate, _staged_submit_many, _staged_completions])
def test_a_multi_stage_batch_does_not_stall_the_loop(probe, run):
    """The heaviest multi-stage reply here (16 prompts of 400 tokens, 4 reasoning samples each,
    16 catalog beams per sample, every logprob), on each route that runs one: /health within
    100 ms meanwhile."""
    sp = {
        "reasoning": {"n": 4, "max_new_tokens": 8, "stop": "t7"},
        "forced_prefix": {"text": "t5"},
        "n": 16,
        "max_new_tokens": 3,
    }
    got: list = []
    worst, _ = steady_health(
        lambda: probe.client(timeout=120),
        lambda c: got.append(run(c, sp)),
        limit_s=STALL_LIMIT_S,
    )
    assert got[-1] == 16
    assert worst < STALL_LIMIT_S, f"/health took {worst * 1000:.0f} ms"


def test_the_probe_fails_a_route_on_the_loop():
    """The probe's proof: a route tokenizing on the event loop stalls /health past the limit,
    the same work through offload() does not."""

    def tokenize(seconds: float = 0.6) -> int:  # the CPU work a careless handler does inline
        # for a fixed time, not a fixed count: on a quiet machine 400,000 splits took 56 ms
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += len(f"t{n % 128}".split("t"))
        return n

    @post("/bad_route_on_the_loop", status_code=200)
    async def bad() -> dict:
        return {"n": tokenize()}

    @post("/good_route_offloaded", status_code=200)
    async def good(state: State) -> dict:
        return {"n": await offload(state, tokenize)}

    with app_server() as srv:
        srv.app.register(bad)
        srv.app.register(good)
        worst_bad, replies = health_while(srv.client, lambda c: c.post("/bad_route_on_the_loop"))
        assert replies.status_code == 200
        assert worst_bad >= STALL_LIMIT_S, f"/health took {worst_bad * 1000:.0f} ms"
        worst_good, _ = steady_health(srv.client, lambda c: c.post("/good_route_offloaded"))
        assert worst_good < STALL_LIMIT_S, f"/health took {worst_good * 1000:.0f} ms"
