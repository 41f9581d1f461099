"""Multi-stage requests against a real `grctl serve` over a tiny Qwen3, transformers' Qwen3 over
the same checkpoint the reference: every behaviour logprob of the reasoning and of the beams,
the beams' scores, one reply equal to the same work as separate requests, the group store
(docs/http-api.md "Multi-stage requests")."""

from __future__ import annotations

import json
import time

import openai
import pytest

from grctl.client import GRClient
from tests.support.catalogs import TWO_LENGTH_ITEMS
from tests.support.checkpoints import load_hf, with_chat_template
from tests.support.reference import hf_token_logprobs

PROMPT = [1, 2, 3, 4]
STOP = 7  # a reasoning stop token
PREFIX = [9, 10]
T1 = 0.7


# chat's prompt is the messages' contents: "t1 t2 t3 t4" is PROMPT
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def served(checkpoint, start_server, tmp_path_factory):
    dst = tmp_path_factory.mktemp("stage-chat") / "ckpt"
    ckpt = with_chat_template(checkpoint(seed=0, tokenizer=True), dst, TEMPLATE)
    cat = tmp_path_factory.mktemp("stage-catalog") / "items.jsonl"
    lines = [
        json.dumps({"item_id": f"i{k}", "token_ids": list(p)})
        for k, p in enumerate(TWO_LENGTH_ITEMS)
    ]
    cat.write_text("\n".join(lines) + "\n")
    srv = start_server(
        "--model-path", str(ckpt), "--catalog-jsonl", str(cat), "--allow-weight-update"
    )
    with srv.client(timeout=120) as http:
        http.url = srv.url  # for the openai package's client
        yield http, load_hf(ckpt)


def body(reasoning=None, **items) -> dict:
    rs = {
        "n": 2,
        "max_new_tokens": 6,
        "temperature": T1,
        "seed": 11,
        "stop_token_ids": [STOP],
        **(reasoning or {}),
    }
    sp = {
        "reasoning": rs,
        "forced_prefix": {"ids": PREFIX},
        "n": 3,
        "max_new_tokens": 3,
        "use_catalog": False,
        **items,
    }
    return {"input_ids": PROMPT, "return_logprob": True, "sampling_params": sp}


def test_every_behaviour_logprob_and_score_equal_transformers(served):
    http, model = served
    r = http.post("/generate", json=body())
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    groups, beams = meta["stage_groups"], meta["beam_results"]
    assert [g["index"] for g in groups] == [0, 1] and len(beams) == 6
    for b in beams:
        bm = b["meta_info"]
        g = groups[bm["group_index"]]
        ids, n_r = b["output_ids"], len(g["reasoning_ids"])
        assert ids[:n_r] == g["reasoning_ids"] and ids[n_r : n_r + 2] == PREFIX
        kinds = [(s["kind"], s["start"], s["end"]) for s in bm["stage_spans"]]
        assert kinds == [
            ("sampled", 0, n_r),
            ("forced", n_r, n_r + 2),
            ("searched", n_r + 2, len(ids)),
        ]
        lps = bm["behaviour_logprobs"]
        assert lps[n_r : n_r + 2] == [None, None]  # forced: no logprob, not a fake 0.0
        assert [e[0] for e in bm["output_token_logprobs"]] == lps
        full = PROMPT + ids
        sampled = hf_token_logprobs(model, full, len(PROMPT), T1)[:n_r]
        searched = hf_token_logprobs(model, full, len(PROMPT) + n_r + 2, 1.0)
        assert lps[:n_r] == pytest.approx(sampled, abs=1e-5)
        assert lps[n_r + 2 :] == pytest.approx(searched, abs=1e-5)
        assert bm["sequence_score"] == pytest.approx(sum(searched), abs=1e-5)
        assert bm["sampling_logprob"] == pytest.approx(sum(searched), abs=1e-5)
        assert g["reasoning_logprob"] == pytest.approx(sum(sampled), abs=1e-5)
        assert bm["group_id"] == g["group_id"]
        assert bm["weight_versions"] == [{"version": "default", "start": 0, "end": len(ids)}]
    # the reasoning ended at its stop token, or at its length
    for g in groups:
        ended = g["reasoning_ids"][-1] == STOP
        assert g["reasoning_finish_reason"] == ("stop" if ended else "length")
        # the item stage continued the sample's own KV (all but the reasoning's last token,
        # never fed), and prefilled the rest once for all its beams
        assert g["cached_tokens"] == len(PROMPT) + len(g["reasoning_ids"]) - 1


def test_equal_to_the_same_work_as_separate_requests(served):
    http, _ = served
    meta = http.post("/generate", json=body()).json()["meta_info"]
    for g in meta["stage_groups"]:
        i = g["index"]
        one = http.post(
            "/generate",
            json={
                "input_ids": PROMPT,
                "return_logprob": True,
                "sampling_params": {
                    "max_new_tokens": 6,
                    "temperature": T1,
                    "seed": 11 + i,
                    "stop_token_ids": [STOP],
                    "use_catalog": False,
                },
            },
        ).json()
        assert one["output_ids"] == g["reasoning_ids"]
        two = http.post(
            "/generate",
            json={
                "input_ids": PROMPT + g["reasoning_ids"] + PREFIX,
                "return_logprob": True,
                "sampling_params": {"n": 3, "max_new_tokens": 3, "use_catalog": False},
            },
        ).json()
        mine = [b for b in meta["beam_results"] if b["meta_info"]["group_index"] == i]
        n = len(g["reasoning_ids"]) + 2
        assert [b["output_ids"][n:] for b in mine] == [
            b["output_ids"] for b in two["meta_info"]["beam_results"]
        ]
        assert [b["meta_info"]["sequence_score"] for b in mine] == pytest.approx(
            [b["meta_info"]["sequence_score"] for b in two["meta_info"]["beam_results"]], abs=1e-6
        )


def test_best_only_verl_gr_spelling_and_custom_params(served):
    http, _ = served
    all_beams = http.post("/generate", json=body({"n": 1})).json()
    best = http.post("/generate", json=body({"n": 1}, beam_return_mode="best_only")).json()
    assert len(best["meta_info"]["beam_results"]) == 1
    assert best["output_ids"] == all_beams["meta_info"]["beam_results"][0]["output_ids"]
    # verl-GR's keys, as verl-GR sends them (inside custom_params too): the same work
    verl = {
        "temperature": T1,
        "seed": 11,
        "stop_token_ids": [STOP],
        "use_catalog": False,
        "beam_width": 3,
        "beam_return_mode": "all_beams",
        "beam_search_params": {"max_tokens": 3, "length_penalty": 0.0},
        "decode_config": {"reasoning": {"max_tokens": 6}},
        "forced_prefix": {"ids": PREFIX},
    }
    for sp in (verl, {"custom_params": verl}):
        got = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
        assert [b["output_ids"] for b in got["meta_info"]["beam_results"]] == [
            b["output_ids"] for b in all_beams["meta_info"]["beam_results"]
        ]


def test_catalog_items_and_stochastic_beams(served):
    http, _ = served
    r = http.post("/generate", json=body(use_catalog=True, temperature=1.0, n=3, seed=5))
    meta = r.json()["meta_info"]
    items = {tuple(p) for p in TWO_LENGTH_ITEMS}
    for b, row in zip(meta["beam_results"], meta["item_results"], strict=True):
        bm = b["meta_info"]
        # the prefix ends in 10, which begins items: the item stage resumes inside them (the
        # catalog's rule), so the searched tokens end a whole item that the prefix begins
        item = b["output_ids"][bm["stage_spans"][-1]["start"] :]
        assert tuple(row["token_ids"]) in items and row["is_complete"]
        assert row["token_ids"] == [10, *item]
        assert bm["finish_reason"]["item_id"] == row["item_id"]
        assert bm["gumbel_key"] is not None
    for g in meta["stage_groups"]:
        assert "gumbel_threshold" in g


def test_beam_groups_are_computed_once_and_served_by_index(served):
    http, _ = served
    sp = {
        "temperature": 1.0,
        "max_new_tokens": 5,
        "beam_width": 4,
        "use_catalog": False,
        "beam_return_mode": "all_beams",
        "beam_search_params": {"max_tokens": 2},
        "forced_prefix": {"ids": PREFIX},
        "beam_group_id": "grp-a",
    }
    replies = [
        http.post(
            "/generate", json={"input_ids": PROMPT, "sampling_params": {**sp, "beam_index": i}}
        ).json()
        for i in range(4)
    ]
    # no seed: a second computation would sample another reasoning
    reasonings = {tuple(r["meta_info"]["stage_groups"][0]["reasoning_ids"]) for r in replies}
    assert len(reasonings) == 1
    assert [r["meta_info"]["beam_index"] for r in replies] == [0, 1, 2, 3]
    assert len({tuple(r["output_ids"]) for r in replies}) == 4
    # served width times: gone, so the id may name a new request
    other = http.post("/generate", json={"input_ids": PROMPT + [5], "sampling_params": sp})
    assert other.status_code == 200
    clash = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    assert clash.status_code == 409, clash.text


@pytest.mark.parametrize(
    "sp, says",
    [
        ({"reasoning": {}, "decode_config": {}}, "one spelling"),
        ({"reasoning": {}, "forced_prefix": {"ids": [1], "text": "t1"}}, "one of text or ids"),
        ({"reasoning": {}, "beam_index": 1}, "beam_index needs beam_group_id"),
        ({"reasoning": {"n": 2}, "beam_group_id": "g"}, "reasoning.n must be 1"),
        ({"decode_config": {}, "n": 2}, "n must be 1"),
        ({"enable_two_stage_rollout": False, "beam_search_params": {}}, "false"),
        ({"reasoning": {"temperature": -1}}, "reasoning"),
        ({"reasoning": {"n": 10**9}}, "reasoning"),
        ({"beam_group_id": "x" * 300}, "beam_group_id"),
        # the engine's own checks of each stage's request say which stage they refused
        ({"reasoning": {"max_new_tokens": 65}}, "the reasoning stage (stage 1): max_new_tokens"),
        ({"reasoning": {"max_new_tokens": 4}, "n": 10**4}, "the item stage (stage 2"),
        (
            {"reasoning": {"max_new_tokens": 10}, "forced_prefix": {"ids": [9] * 500}},
            "the item stage (stage 2, after the longest reasoning and the prefix): prompt of 514",
        ),
    ],
)
def test_bad_multi_stage_bodies_are_400(served, sp, says):
    http, _ = served
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    assert r.status_code == 400 and says in r.text, r.text


def comparable(reply: dict) -> dict:
    """A reply less what differs between two runs of the same work: its latency."""
    meta = {k: v for k, v in reply["meta_info"].items() if k != "e2e_latency"}
    return {**reply, "meta_info": meta}


def assert_same(a, b, where: str = "") -> None:
    """Equal JSON, floats to 1e-5 (a batch's kernels round otherwise than one request's)."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-5), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def uncached(reply: dict) -> dict:
    meta = {k: v for k, v in reply["meta_info"].items() if k != "cached_tokens"}
    meta["stage_groups"] = [
        {k: v for k, v in g.items() if k != "cached_tokens"} for g in meta["stage_groups"]
    ]
    return {**reply, "meta_info": meta}


def generated(http, b: dict) -> dict:
    assert http.get("/flush_cache").status_code == 200  # the same cached_tokens each run
    r = http.post("/generate", json=b)
    assert r.status_code == 200, r.text
    return r.json()


def fetched(http, rid: str) -> dict:
    deadline = time.monotonic() + 60
    while not (p := http.get(f"/poll/{rid}").json())["ready"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = http.get(f"/result/{rid}", params={"timeout": 60})
    assert r.status_code == 200, r.text
    assert comparable(p["response"]) == comparable(r.json())  # poll peeks, result takes
    assert http.get(f"/poll/{rid}").status_code == 404  # fetched: gone
    return r.json()


def test_submit_poll_result_equal_generate(served):
    http, model = served
    b = {**body(), "rid": "st-submit"}
    ref = generated(http, b)
    assert http.get("/flush_cache").status_code == 200
    r = http.post("/submit", json=b)
    assert r.status_code == 202 and r.json()["request_id"] == "st-submit", r.text
    got = fetched(http, "st-submit")
    assert comparable(got) == comparable(ref)
    # and against transformers, not only against /generate
    for beam in got["meta_info"]["beam_results"]:
        ids, lps = beam["output_ids"], beam["meta_info"]["behaviour_logprobs"]
        n_r = beam["meta_info"]["stage_spans"][0]["end"]
        ref_lps = hf_token_logprobs(model, PROMPT + ids, len(PROMPT), T1)[:n_r]
        assert lps[:n_r] == pytest.approx(ref_lps, abs=1e-5)


def test_grclient_submits_and_decodes_one(served):
    """grctl's own client: /submit then /result, the reply decoded into its Structs."""
    http, _ = served
    b = body()
    ref = generated(http, {**b, "rid": "st-client"})
    assert http.get("/flush_cache").status_code == 200
    with GRClient(http.url) as gr:
        rid = gr.submit(PROMPT, b["sampling_params"], rid="st-client", return_logprob=True)
        assert rid.request_id == "st-client"
        reply = gr.result("st-client", wait=60)
        assert gr.abort_request(rid="st-client").num_aborted_requests == 0  # finished
    meta = reply.meta_info
    assert [g.reasoning_ids for g in meta.stage_groups] == [
        g["reasoning_ids"] for g in ref["meta_info"]["stage_groups"]
    ]
    assert [b.output_ids for b in meta.beam_results] == [
        b["output_ids"] for b in ref["meta_info"]["beam_results"]
    ]
    assert [s.kind for s in meta.beam_results[0].meta_info.stage_spans] == [
        "sampled",
        "forced",
        "searched",
    ]


def test_submit_many_runs_multi_and_one_stage_rows(served):
    http, _ = served
    one = {"input_ids": PROMPT, "rid": "sm-one", "sampling_params": {"max_new_tokens": 3}}
    rows = [{**body(), "rid": "sm-a"}, one, {**body({"seed": 3}), "rid": "sm-b"}]
    refs = [generated(http, row) for row in rows]
    assert http.get("/flush_cache").status_code == 200
    r = http.post("/submit_many", json={"requests": rows})
    assert r.status_code == 202 and r.json()["request_ids"] == ["sm-a", "sm-one", "sm-b"], r.text
    for row, ref in zip(rows, refs, strict=True):
        got = http.get(f"/result/{row['rid']}", params={"timeout": 60})
        assert got.status_code == 200, got.text
        if row is one:  # a one-stage reply: its latency and cached prompt may differ
            assert got.json()["output_ids"] == ref["output_ids"]
        else:  # the multi-stage rows ran as one batch of their own: the same replies, but
            # what the prefix cache held (the rows share their prompt), to float rounding
            assert_same(uncached(comparable(got.json())), uncached(comparable(ref)))


def test_submit_refusals(served):
    http, _ = served
    bad = body({"temperature": 1e308})
    r = http.post("/submit", json=bad)
    assert r.status_code == 400 and "reasoning.temperature" in r.json()["error"]["message"]
    r = http.post("/submit_many", json={"requests": [{**body(), "rid": "x1"}, bad]})
    assert r.status_code == 400, r.text
    assert http.get("/poll/x1").status_code == 404  # all or none: nothing was queued
    # an id in use by a multi-stage request is taken for one-stage requests too
    assert http.post("/submit", json={**body(), "rid": "dup"}).status_code == 202
    one = {"input_ids": PROMPT, "rid": "dup", "sampling_params": {"max_new_tokens": 1}}
    assert http.post("/submit", json=one).status_code == 409
    assert http.post("/submit", json={**body(), "rid": "dup"}).status_code == 409
    assert http.get("/result/dup", params={"timeout": 60}).status_code == 200
    # paused: refused at once, as any submit is, and nothing is left queued
    assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    try:
        r = http.post("/submit", json={**body(), "rid": "paused"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "paused", r.text
    finally:
        assert http.post("/continue_generation").status_code == 200
    assert http.get("/poll/paused").status_code == 404


@pytest.mark.parametrize(
    "field, sp",
    [
        ("stage2_temperature", {"decode_config": {}, "stage2_temperature": 1e308}),
        ("beam_search_params.temperature", {"beam_search_params": {"temperature": 1e308}}),
        ("beam_search_params.length_penalty", {"beam_search_params": {"length_penalty": 1e308}}),
        ("reasoning.temperature", {"reasoning": {"temperature": 1e308}}),
        ("stage2_top_k", {"decode_config": {}, "stage2_top_k": 2**63}),
        ("reasoning.top_k", {"reasoning": {"top_k": 2**31}}),
    ],
)
def test_stage_knobs_past_float32_are_a_400_naming_them(served, field, sp):
    http, _ = served
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.text


def completion_body(**kw) -> dict:
    sp = body()["sampling_params"]
    return {
        "prompt": PROMPT,
        "reasoning": sp["reasoning"],
        "forced_prefix": sp["forced_prefix"],
        "n": sp["n"],
        "max_tokens": sp["max_new_tokens"],
        "temperature": 0.0,
        "use_catalog": False,
        "logprobs": 0,
        **kw,
    }


def test_completions_take_the_stages_as_extra_fields(served):
    http, _ = served
    ref = generated(http, {**body(), "rid": "cmp"})
    r = http.post("/v1/completions", json=completion_body(rid="cmp"))
    assert r.status_code == 200, r.text
    reply = r.json()
    beams = ref["meta_info"]["beam_results"]
    assert reply["id"] == "cmpl-cmp" and len(reply["choices"]) == len(beams) == 6
    for i, (c, b) in enumerate(zip(reply["choices"], beams, strict=True)):
        cm, bm = c["meta_info"], b["meta_info"]
        assert c["index"] == i and cm["output_ids"] == b["output_ids"]
        assert (cm["group_id"], cm["group_index"], cm["beam_index"]) == (
            bm["group_id"],
            bm["group_index"],
            bm["beam_index"],
        )
        assert cm["stage_spans"] == bm["stage_spans"]
        # every choice its own behaviour logprobs, the forced prefix null
        assert c["logprobs"]["token_logprobs"] == pytest.approx(bm["behaviour_logprobs"])
        assert c["logprobs"]["tokens"] == [f"t{t}" for t in b["output_ids"]]
        assert (
            c["finish_reason"] == {"length": "length", "stop": "stop"}[bm["finish_reason"]["type"]]
        )
    usage = reply["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)
    assert usage["completion_tokens"] == ref["meta_info"]["completion_tokens"]
    # a batch of prompts: /generate's batch, choices prompt by prompt
    two = http.post("/v1/completions", json=completion_body(prompt=[PROMPT, PROMPT[:3]]))
    ref2 = generated(http, {**body(), "input_ids": [PROMPT, PROMPT[:3]]})
    assert two.status_code == 200, two.text
    assert [c["meta_info"]["output_ids"] for c in two.json()["choices"]] == [
        b["output_ids"] for rep in ref2 for b in rep["meta_info"]["beam_results"]
    ]


def test_the_openai_package_sends_them_as_extra_body(served):
    http, _ = served
    ref = generated(http, {**body(), "rid": "oa"})
    sp = body()["sampling_params"]
    oa = openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0)
    extra = {k: sp[k] for k in ("reasoning", "forced_prefix", "use_catalog")}
    done = oa.completions.create(
        model="m", prompt=PROMPT, n=3, max_tokens=3, temperature=0.0, logprobs=0,
        extra_body={**extra, "rid": "oa"},
    )  # fmt: skip
    assert [c.meta_info["output_ids"] for c in done.choices] == [
        b["output_ids"] for b in ref["meta_info"]["beam_results"]
    ]
    chat = oa.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "t1 t2 t3 t4"}], n=3, max_tokens=3,
        temperature=0.0, logprobs=True, extra_body={**extra, "rid": "oa"},
    )  # fmt: skip
    beams = ref["meta_info"]["beam_results"]
    assert [c.meta_info["output_ids"] for c in chat.choices] == [b["output_ids"] for b in beams]
    for c, b in zip(chat.choices, beams, strict=True):
        assert [t.logprob for t in c.logprobs.content] == pytest.approx(
            b["meta_info"]["behaviour_logprobs"]
        )
        assert c.message.content == " ".join(f"t{t}" for t in b["output_ids"])
        assert c.meta_info["stage_spans"] == b["meta_info"]["stage_spans"]
    # chat has no default item length to offer: the body names it
    bare = {"messages": [{"role": "user", "content": "t1"}], **extra}
    r = http.post("/v1/chat/completions", json=bare)
    assert r.status_code == 400 and "max_tokens" in r.text, r.text


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"reasoning": None, "forced_prefix": {"ids": PREFIX}}, "send reasoning"),
        ({"echo": True}, "echo"),
        ({"logprobs": 2}, "alternatives"),
        ({"reasoning": {"temperature": 1e308}}, "reasoning.temperature"),
        ({"reasoning": {"n": [2]}}, "reasoning.n"),
    ],
)
def test_bad_multi_stage_completions_are_400(served, kw, says):
    http, _ = served
    r = http.post("/v1/completions", json=completion_body(**kw))
    assert r.status_code == 400 and says in r.text, r.text


def results_counted(http) -> dict[tuple[str, str], float]:
    """/metrics' gr_generate_results_total and e2e-latency count, parsed with
    prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    got: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == "gr_generate_results_total":
                got[("results", s.labels["finish_reason"])] = s.value
            elif s.name == "sglang:e2e_request_latency_seconds_count":
                got[("e2e", "")] = s.value
    return got


def test_a_multi_stage_reply_counts_once_in_metrics(served):
    """Each reply counts once under its finish reason, when its last stage ends, through
    /generate and through /submit alike (its stages are engine requests of their own, but the
    client sees one reply)."""
    http, _ = served
    before = results_counted(http)
    one = generated(http, body())
    r = http.post("/submit", json={**body(), "rid": "st-metrics"})
    assert r.status_code == 202, r.text
    two = fetched(http, "st-metrics")
    after = results_counted(http)
    ends = [one["meta_info"]["finish_reason"]["type"], two["meta_info"]["finish_reason"]["type"]]
    for end in set(ends):
        key = ("results", end)
        assert after[key] - before.get(key, 0.0) == ends.count(end), (before, after)
    assert after[("e2e", "")] - before.get(("e2e", ""), 0.0) == 2
