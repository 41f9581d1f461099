"""Hostile and malformed input on every route: always a 4xx in the error shape, never a 5xx,
the weights checksum unchanged, the server alive and serving the same outputs afterwards."""

from __future__ import annotations

import base64
import json
import socket
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grctl.weights.wire.encode import MultiprocessingSerializer
from grctl.weights.wire.records import FlattenedTensorMetadata
from tests.support import hostile_pickles
from tests.support.checkpoints import write_checkpoint
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
    return start_server("--allow-weight-update", *args)


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
        # unknown routes and methods
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
