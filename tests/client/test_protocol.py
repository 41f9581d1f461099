"""The client and the server agree on the wire: for every route, the client reads the reply with
the Struct the server declares and sends only keys the server's body reads; every reply Struct
reads an empty object (SGLang leaves grctl's keys out); the server's Strict* variants differ from
the shared Structs only in which keys they always send; no wire type shares a name with another
grctl type. In process, no server started."""

from __future__ import annotations

import ast
import inspect
import re
import types
import typing
from pathlib import Path

import msgspec
import pytest
from litestar import Litestar, Response

import grctl
from grctl.client.calls import Call, request_body, status_of, text
from grctl.client.routes import Routes
from grctl.protocol import catalog, generate, info, weights
from grctl.server.routes.catalog import catalog_routes
from grctl.server.routes.delta import delta_router
from grctl.server.routes.generate import generate_routes
from grctl.server.routes.info import info_routes
from grctl.server.routes.memory import memory_router
from grctl.server.routes.updates import update_router
from grctl.server.routes.weights import weight_router

PROTOCOL = (catalog, generate, info, weights)
# Routes whose handler reads the query and the JSON body itself (server/params.py).
MERGED_BODIES = {
    "/get_weights_by_name": weights.GetWeightsBody,
    "/release_memory_occupation": weights.MemoryBody,
    "/resume_memory_occupation": weights.MemoryBody,
    "/weights_checker": weights.WeightsCheckerBody,
}
# One call of every client method, with every optional body key given.
CALLS = {
    "generate": lambda r: r.generate(
        [1, 2], {"n": 2}, text=None, return_logprob=True, rid="a", use_catalog=False,
        logits_processors=[{"type": "token_suppress", "token_ids": [3]}], max_new_tokens=2,
        temperature=0.5, top_p=0.9, top_k=4, seed=1, stop_token_ids=[5], ignore_eos=True,
    ),
    "generate_batch": lambda r: r.generate_batch([[1], [2]], [{"n": 1}, {"n": 2}], rid=["a", "b"]),
    "submit": lambda r: r.submit([1, 2], max_new_tokens=2, rid="a"),
    "submit_many": lambda r: r.submit_many([request_body([1], max_new_tokens=1)]),
    "poll": lambda r: r.poll("a"),
    "result": lambda r: r.result("a", wait=1.0),
    "cancel": lambda r: r.cancel("a"),
    "abort_request": lambda r: r.abort_request(rid="a"),
    "health": lambda r: r.health(),
    "ready": lambda r: r.ready(),
    "status": lambda r: r.status(),
    "metrics": lambda r: r.metrics(),
    "server_info": lambda r: r.server_info(),
    "model_info": lambda r: r.model_info(),
    "health_generate": lambda r: r.health_generate(),
    "flush_cache": lambda r: r.flush_cache(wait=1.0),
    "catalog_status": lambda r: r.catalog_status(),
    "catalog_reload": lambda r: r.catalog_reload("/c.jsonl"),
    "catalog_rollback": lambda r: r.catalog_rollback(),
    "release_memory_occupation": lambda r: r.release_memory_occupation(["kv_cache"]),
    "resume_memory_occupation": lambda r: r.resume_memory_occupation(["kv_cache"]),
    "pause_generation": lambda r: r.pause_generation("retract"),
    "continue_generation": lambda r: r.continue_generation(),
    "get_weight_version": lambda r: r.get_weight_version(),
    "update_weight_version": lambda r: r.update_weight_version(7, abort_all_requests=True),
    "begin_weight_update": lambda r: r.begin_weight_update(),
    "end_weight_update": lambda r: r.end_weight_update(),
    "get_weights_by_name": lambda r: r.get_weights_by_name("lm_head.weight", 4),
    "weights_checker": lambda r: r.weights_checker("snapshot"),
    "update_weights_from_disk": lambda r: r.update_weights_from_disk(
        "/ckpt", weight_version=7, token_step=3, abort_all_requests=True, load_format="auto"
    ),
    "pull_weights": lambda r: r.pull_weights(
        "/deltas", 3, weight_version=3, token_step=3, abort_all_requests=True
    ),
    "update_weights_from_tensor": lambda r: r.update_weights_from_tensor(
        ["payload"], weight_version=7, token_step=3, flush_cache=False, abort_all_requests=True
    ),
    "init_weights_update_group": lambda r: r.init_weights_update_group(
        "127.0.0.1", 29500, 1, 2, group_name="g", backend="gloo"
    ),
    "update_weights_from_distributed": lambda r: r.update_weights_from_distributed(
        ["w"], ["float32"], [[2, 2]], group_name="g", load_format="direct", weight_version=7,
        token_step=3, flush_cache=False,
    ),
    "destroy_weights_update_group": lambda r: r.destroy_weights_update_group("g"),
}  # fmt: skip


class Recorder(Routes):
    def __init__(self) -> None:
        self.calls: list[Call] = []

    def _call(self, call: Call) -> None:
        self.calls.append(call)


def server_routes() -> list[tuple[str, re.Pattern, object]]:
    """(method, path pattern, handler) for every route the app serves."""
    app = Litestar(
        route_handlers=[
            *generate_routes,
            *info_routes,
            weight_router,
            update_router,
            memory_router,
            delta_router,
            *catalog_routes,
        ],
        openapi_config=None,
    )
    rows = []
    for route in app.routes:
        pattern = re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", route.path_format) + "$")
        for handler in route.route_handlers:
            rows += [(m, pattern, handler) for m in handler.http_methods if m != "OPTIONS"]
    return rows


def handler_for(call: Call, routes) -> object:
    found = [h for m, p, h in routes if m == call.method and p.match(call.path)]
    assert len(found) == 1, f"{call.method} {call.path}: {len(found)} server routes"
    return found[0]


def reply_types(annotation) -> set:
    """The Structs a handler's return annotation says it sends (Response[X] -> X)."""
    if typing.get_origin(annotation) is Response:
        return reply_types(typing.get_args(annotation)[0])
    if isinstance(annotation, types.UnionType):
        return set().union(*(reply_types(a) for a in typing.get_args(annotation)))
    return {annotation}


def field_names(cls) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls)}


def body_struct(handler, path: str):
    data = handler.parsed_fn_signature.parameters.get("data")
    if data is None:
        return MERGED_BODIES.get(path)
    (struct,) = (a for a in typing.get_args(data.annotation) if a is not type(None))
    return struct


def query_names(handler) -> set[str]:
    params = handler.parsed_fn_signature.parameters
    return {n for n in params if n not in ("state", "request", "data")}


def recorded() -> dict[str, Call]:
    calls = {}
    for name, make in CALLS.items():
        rec = Recorder()
        make(rec)
        (calls[name],) = rec.calls
    return calls


def test_every_client_method_is_checked():
    public = {n for n, _ in inspect.getmembers(Routes, inspect.isfunction) if not n.startswith("_")}
    assert public == set(CALLS)


def test_client_reads_each_reply_with_the_struct_the_server_declares():
    routes = server_routes()
    for name, call in recorded().items():
        declared = reply_types(handler_for(call, routes).parsed_fn_signature.return_type.annotation)
        if call.decode is text:
            assert declared == {str}, name
        elif call.decode is status_of:  # a flat object; the client types its weights section
            assert declared == {dict[str, typing.Any]}, name
            assert issubclass(weights.StatusWeights, weights.WeightVersionResponse)
        else:
            read = call.decode.keywords["type"]
            read = typing.get_args(read)[0] if typing.get_origin(read) is list else read
            assert read in declared, f"{name}: the client reads {read}, the server sends {declared}"


def test_client_sends_only_keys_the_server_reads():
    routes = server_routes()
    for name, call in recorded().items():
        handler = handler_for(call, routes)
        struct = body_struct(handler, call.path.split("?")[0])
        sent = set(call.json or {}) | set(call.params or {})
        readable = (field_names(struct) if struct else set()) | query_names(handler)
        assert sent <= readable, f"{name} sends {sent - readable}, which the server ignores"
        sampling = (call.json or {}).get("sampling_params")
        for sp in sampling if isinstance(sampling, list) else [sampling] if sampling else []:
            assert set(sp) <= field_names(generate.SamplingParamsBody), name


def reply_structs() -> list[type]:
    """Every Struct of protocol/ that is read from a reply (not a *Body)."""
    found = []
    for mod in PROTOCOL:
        for name, cls in vars(mod).items():
            if (
                isinstance(cls, type)
                and issubclass(cls, msgspec.Struct)
                and cls.__module__ == mod.__name__
            ):
                if not name.endswith("Body") and not name.startswith("Strict"):
                    found.append(cls)
    return found


@pytest.mark.parametrize("cls", reply_structs(), ids=lambda c: c.__name__)
def test_every_reply_reads_an_empty_object(cls):
    msgspec.convert({}, cls, strict=False)


def test_strict_variants_only_require_what_the_server_always_sends():
    stricts = [
        cls
        for mod in PROTOCOL
        for name, cls in vars(mod).items()
        if name.startswith("Strict") and cls.__module__ == mod.__name__
    ]
    assert {c.__name__ for c in stricts} == {
        "StrictMetaInfo",
        "StrictBeamMetaInfo",
        "StrictFlushCacheResponse",
        "StrictWeightsCheckerResponse",
    }
    for strict in stricts:
        (shared,) = strict.__bases__
        assert [(f.name, f.type) for f in msgspec.structs.fields(strict)] == [
            (f.name, f.type) for f in msgspec.structs.fields(shared)
        ], strict.__name__


def test_strict_replies_leave_out_only_unset_optional_keys():
    finish = generate.FinishReason(type="length", length=0)
    meta = generate.StrictMetaInfo(
        id="r", prompt_tokens=1, completion_tokens=0, cached_tokens=0, finish_reason=finish,
        weight_version="", weight_versions=[], num_retractions=0, beam_width=1, beam_results=[],
        e2e_latency=0.0,
    )  # fmt: skip
    sent = msgspec.to_builtins(meta)
    assert set(sent) == field_names(generate.MetaInfo) - {
        "sequence_score",
        "output_token_logprobs",
        "output_token_logprobs_length",
        "output_top_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "item_results",
        "catalog_version",
        "kv_recomputed_at",
        "item_prefix_len",
        "unknown_exclude_item_ids",
        "gumbel_threshold",
        "output_token_sampling_mask",
        "output_token_sampling_logprobs",
        "output_token_sampling_mask_length",
        "top_p_token_ids",
        "top_p_token_offsets",
        # a multi-stage request's (docs/http-api.md "Multi-stage requests")
        "stage_groups",
        "stage_restarts",
        "beam_group_id",
        "beam_index",
    }
    assert sent["finish_reason"] == {"type": "length", "length": 0}
    ok = info.StrictFlushCacheResponse(success=True, entries_cleared=0)
    assert msgspec.to_builtins(ok) == {"success": True, "entries_cleared": 0}
    snap = weights.StrictWeightsCheckerResponse(success=True, message="snapshot of 3 parameters")
    assert msgspec.to_builtins(snap) == {"success": True, "message": "snapshot of 3 parameters"}


def test_weight_versions_are_one_string_on_both_sides():
    assert weights.version_str(7) == weights.version_str(7.0) == weights.version_str("7") == "7"
    assert weights.version_str(None) is None and weights.version_str(7.5) == "7.5"
    call = recorded()["update_weights_from_disk"]
    assert call.json["weight_version"] == "7"


def test_no_wire_type_shares_a_name_with_another_grctl_type():
    protocol_dir = Path(grctl.__file__).parent / "protocol"
    wire = {cls.__name__ for mod in PROTOCOL for cls in vars(mod).values() if isinstance(cls, type)
            and cls.__module__ == mod.__name__}  # fmt: skip
    others = {}
    for path in Path(grctl.__file__).parent.rglob("*.py"):
        if protocol_dir in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                others.setdefault(node.name, path)
    clashes = {name: str(others[name]) for name in wire & set(others)}
    assert not clashes
