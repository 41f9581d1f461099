"""What a request that leaves a field out gets: max_new_tokens from the served catalog's depth
(else SGLang's 128, within --max-new-tokens and the context), the exclude_item_ids that name no
item said in the reply, and docs/http-api.md's table of the defaults that differ from SGLang's
true to the code."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from grctl.protocol.generate import SamplingParamsBody
from tests.support.appserver import app_server
from tests.support.catalogs import write_catalog

PROMPT = [1, 7, 300, 600, 900]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"


@pytest.fixture(scope="module")
def catalog_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    items = write_catalog(root / "items.jsonl", 3, 500)
    with app_server("--catalog-jsonl", str(root / "items.jsonl")) as srv:
        yield srv, items


def generate(srv, **sampling) -> dict:
    with srv.client() as c:
        resp = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": sampling})
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]


def test_catalog_beams_default_to_whole_items(catalog_server):
    """{"n": 4} under a catalog of 3-token items: 4 complete items (the default was one
    token: 4 partial, incomplete beams)."""
    srv, items = catalog_server
    meta = generate(srv, n=4)
    assert len(meta["beam_results"]) == 4
    for beam, row in zip(meta["beam_results"], meta["item_results"], strict=True):
        assert len(beam["output_ids"]) == 3
        assert row["is_complete"] and row["item_ids"] == items[tuple(beam["output_ids"])]
        assert beam["meta_info"]["finish_reason"]["type"] == "stop"


def test_free_beams_default_to_sglangs_length_within_the_limit(catalog_server):
    """use_catalog false: SGLang's 128, held to --max-new-tokens (64 by default)."""
    srv, _ = catalog_server
    meta = generate(srv, use_catalog=False, ignore_eos=True)
    assert meta["completion_tokens"] == srv.config.engine.max_new_tokens == 64
    assert meta["finish_reason"] == {"type": "length", "length": 64}


@pytest.mark.parametrize(
    ("flags", "prompt_len", "want"),
    [
        (("--max-new-tokens", "200"), 5, 128),  # SGLang's default
        (("--max-new-tokens", "200", "--max-context-len", "40"), 30, 10),  # the context left
    ],
)
def test_the_default_never_turns_a_prompt_into_a_400(flags, prompt_len, want):
    with app_server(*flags) as srv, srv.client() as c:
        body = {"input_ids": [5] * prompt_len, "sampling_params": {"ignore_eos": True}}
        resp = c.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["output_ids"]) == want


def test_an_explicit_length_wins(catalog_server):
    srv, _ = catalog_server
    meta = generate(srv, n=2, max_new_tokens=2)
    assert all(len(b["output_ids"]) == 2 for b in meta["beam_results"])


def test_unknown_excluded_ids_are_named_in_the_reply(catalog_server):
    srv, items = catalog_server
    best = generate(srv, n=2)["item_results"][0]["item_id"]
    missing = [10**9, "no-such-item", -5]
    meta = generate(srv, n=2, exclude_item_ids=[best, *missing])
    assert meta["unknown_exclude_item_ids"] == missing
    assert all(best not in row["item_ids"] for row in meta["item_results"])  # still excluded
    assert "unknown_exclude_item_ids" not in generate(srv, n=2, exclude_item_ids=[best])


def _documented_defaults() -> dict[str, str]:
    """The grctl column of http-api.md's "Defaults that differ from SGLang" table."""
    text = DOCS.read_text()
    section = text.split("#### Defaults that differ from SGLang", 1)[1]
    section = section[section.index("| key |") :].split("\n\n", 1)[0]  # the table alone
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \|", section, re.M)
    assert rows, "the table is gone"
    return {key: grctl.strip() for key, grctl, _ in rows}


def test_the_defaults_table_is_true_to_the_code():
    defaults = msgspec.structs.asdict(SamplingParamsBody())
    documented = _documented_defaults()
    for key, value in documented.items():
        assert key in defaults, f"{key} is not a sampling_params field"
        literal = re.match(r"`([^`]+)`", value)
        if literal and defaults[key] is not None:
            assert msgspec.json.decode(literal.group(1)) == defaults[key], key
    for key in ("max_new_tokens", "temperature", "n", "skip_special_tokens"):
        assert key in documented


def test_every_sampling_field_is_described_in_the_openapi_schema():
    """/schema/openapi.json (what /docs renders): a description on each sampling_params field,
    and the schema still refuses what the Struct refuses (the descriptions wrap the types)."""
    with app_server() as srv, srv.client() as c:
        spec = c.get("/schema/openapi.json").json()
        bad = c.post("/generate", json={"input_ids": [1], "sampling_params": {"top_p": 0}})
    props = spec["components"]["schemas"]["SamplingParamsBody"]["properties"]
    fields = {f.name for f in msgspec.structs.fields(SamplingParamsBody)}
    assert set(props) == fields
    undescribed = sorted(k for k, v in props.items() if len(v.get("description", "")) < 20)
    assert not undescribed, undescribed
    assert bad.status_code == 400 and "top_p" in bad.text


def test_a_multi_stage_reasoning_defaults_within_the_limit(catalog_server):
    """reasoning without max_new_tokens: SGLang's 128 held to --max-new-tokens (64), then the
    item stage to the catalog's depth (the old default, 256, was a 400 under the default
    limit)."""
    srv, items = catalog_server
    sp = {"reasoning": {"ignore_eos": True}, "forced_prefix": {"ids": [5]}, "n": 2}
    with srv.client() as c:
        resp = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    assert resp.status_code == 200, resp.text
    beams = resp.json()["meta_info"]["beam_results"]
    for beam in beams:
        ids = beam["output_ids"]
        assert len(ids) == 64 + 1 + 3 and ids[64] == 5
        assert tuple(ids[65:]) in items
