"""Catalog routes in process (Litestar's test client): status, reload, rollback, every bad file,
reload under load."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc

import httpx
import pytest

from grctl.catalog.loader import read_catalog
from grctl.errors import ValidationError
from tests.support.appserver import app_server
from tests.support.catalogs import write_catalog
from tests.support.serverproc import assert_error

KEY = "catalog-test-key"


def generate(client: httpx.Client, n: int = 4, **sampling) -> dict:
    body = {"input_ids": [1, 7, 300, 600, 900], "sampling_params": {"n": n, "max_new_tokens": 3}}
    body["sampling_params"].update(sampling)
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]


def check_items(meta: dict, items: dict, finish: str = "stop") -> None:
    rows = meta["item_results"]
    assert len(rows) == len(meta["beam_results"]) == meta["beam_width"]
    for rank, (row, beam) in enumerate(zip(rows, meta["beam_results"], strict=True)):
        assert row["rank"] == rank and row["token_ids"] == beam["output_ids"]
        assert row["item_ids"] == items[tuple(row["token_ids"])]
        assert row["item_id"] == row["item_ids"][0] and row["is_complete"] is True
        assert row["score"] == pytest.approx(beam["meta_info"]["sequence_score"])
        # SGLang's "stop" (no stop token matched), the item named
        want = {"type": finish, "item_id": row["item_id"]}
        assert beam["meta_info"]["finish_reason"] == want
    assert meta["finish_reason"] == {"type": finish, "item_id": rows[0]["item_id"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalogs")
    v1 = write_catalog(root / "v1.jsonl", 1, 3000)
    with app_server(
        "--catalog-jsonl",
        str(root / "v1.jsonl"),
        "--allow-catalog-reload",
        "--api-key",
        KEY,
        "--weights-root",
        str(root),
        "--max-catalog-bytes",
        "400000",
    ) as srv:
        with srv.client(headers={"X-GR-API-Key": KEY}) as client:
            yield srv, client, root, v1


def test_status_generate_and_submit(served):
    srv, client, root, v1 = served
    with srv.client() as anonymous:
        assert_error(anonymous.get("/catalog/status"), 401, "unauthorized")
    status = client.get("/catalog/status").json()
    assert status["loaded"] and status["num_items"] == 3000 and status["max_depth"] == 3
    assert status["source"].endswith("v1.jsonl") and status["nbytes"] > 0
    assert status["self_delimiting"]  # three levels of their own 256 codes
    version = status["version"]
    assert client.get("/status").json()["catalog"]["num_items"] == 3000
    meta = generate(client)
    assert meta["catalog_version"] == version
    check_items(meta, v1)
    check_items(generate(client, item_finish_reason="item_complete"), v1, "item_complete")
    cut = generate(client, max_new_tokens=2)  # short of an item: SGLang's length, no item
    assert cut["finish_reason"] == {"type": "length", "length": 2}
    assert_error(
        client.post(
            "/generate",
            json={"input_ids": [1, 2], "sampling_params": {"item_finish_reason": "done"}},
        ),
        400,
        "validation_error",
    )
    free = generate(client, use_catalog=False)
    assert "item_results" not in free and "catalog_version" not in free
    body = {"input_ids": [3, 4, 5], "sampling_params": {"n": 2, "max_new_tokens": 3}}
    rid = client.post("/submit", json=body).json()["request_id"]
    result = client.get(f"/result/{rid}", params={"timeout": 60}).json()
    assert result["meta_info"]["catalog_version"] == version
    check_items(result["meta_info"], v1)


BAD_FILES = {
    "missing": (None, "cannot be read"),
    "not_jsonl": ('{"item_id": 1, "token_ids": [300, 600, 900]}\n{oops\n', "line 2"),
    "no_token_ids": ('{"item_id": 1, "token_ids": [300]}\n\n{"item_id": 2}\n', "line 3"),
    "out_of_vocab": ('{"item_id": 1, "token_ids": [300, 1024]}\n', "line 1: token id 1024"),
    "negative": ('{"item_id": 1, "token_ids": [300]}\n{"item_id": 1, "token_ids": [-3]}', "line 2"),
    "empty_path": ('{"item_id": 1, "token_ids": []}\n', "line 1: an empty token_ids"),
    "empty_file": ("\n  \n", "no items"),
    "bad_item_id": ('{"item_id": 1.5, "token_ids": [300]}\n', "line 1"),
    "too_big": ('{"item_id": 1, "token_ids": [300]}\n' * 20000, "--max-catalog-bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_400_naming_the_line_and_old_catalog_serves(served, case):
    srv, client, root, v1 = served
    before = client.get("/catalog/status").json()
    content, needle = BAD_FILES[case]
    path = root / f"bad-{case}.jsonl"
    if content is not None:
        path.write_text(content)
    err = assert_error(
        client.post("/catalog/reload", json={"path": str(path)}), 400, "validation_error"
    )
    assert needle in err["message"], err["message"]
    assert client.get("/catalog/status").json() == before
    check_items(generate(client), v1)


def test_only_a_regular_file_is_read(served):
    """A FIFO used to block the reload forever, holding the reload lock (every later reload
    waited behind it); a directory or a device is no catalog either. Each is a 400 at once."""
    srv, client, root, v1 = served
    before = client.get("/catalog/status").json()
    fifo = root / "catalog.fifo"
    os.mkfifo(fifo)
    (root / "a-directory").mkdir()
    for path in (fifo, root / "a-directory"):
        replies: list[httpx.Response] = []

        def reload(p=path, out=replies) -> None:
            out.append(client.post("/catalog/reload", json={"path": str(p)}))

        call = threading.Thread(target=reload, daemon=True)
        call.start()
        call.join(10)
        if call.is_alive():  # unblock the stuck open so the server can stop
            with open(fifo, "wb"):
                pass
            call.join(10)
        assert replies, f"/catalog/reload of {path.name} did not answer within 10 s"
        err = assert_error(replies[0], 400, "validation_error")
        assert "is not a regular file" in err["message"], err["message"]
    assert client.get("/catalog/status").json() == before
    check_items(generate(client), v1)


def test_a_device_is_refused_before_a_byte_is_read():
    """/dev/zero reports size 0 and never ends: read up to --max-catalog-bytes, it used to take
    that much memory before the refusal; now it is refused from its fstat, nothing read."""
    tracemalloc.start()
    try:
        with pytest.raises(ValidationError, match="is not a regular file"):
            read_catalog("/dev/zero", max_bytes=64 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_paths_outside_weights_root_and_bad_bodies(served, tmp_path):
    srv, client, root, v1 = served
    outside = tmp_path / "outside.jsonl"
    write_catalog(outside, 3, 10)
    assert_error(client.post("/catalog/reload", json={"path": str(outside)}), 403, "forbidden")
    escape = str(root / ".." / outside.parent.name / "outside.jsonl")
    assert_error(client.post("/catalog/reload", json={"path": escape}), 403, "forbidden")
    assert_error(client.post("/catalog/reload", json={}), 400, "validation_error")
    assert_error(client.post("/catalog/reload", json={"path": 5}), 400, "validation_error")
    bad_proc = {"input_ids": [1], "logits_processors": [{"type": "nope"}]}
    assert_error(client.post("/generate", json=bad_proc), 400, "validation_error")
    bad_proc = {
        "input_ids": [1],
        "logits_processors": [{"type": "bad_tokens", "token_ids": [5000]}],
    }
    assert_error(client.post("/generate", json=bad_proc), 400, "validation_error")


def test_reload_under_load_and_rollback(served):
    """Generations run while the catalog is reloaded and rolled back: every answer names a
    version, and every item id it returns exists in that version's catalog."""
    srv, client, root, v1 = served
    base = client.get("/catalog/status").json()["version"]
    v2 = write_catalog(root / "v2.jsonl", 2, 500, codes=40, id_prefix="two-")
    v3 = write_catalog(root / "v3.jsonl", 3, 800, codes=64, id_prefix="three-")
    by_version = {base: v1}
    answers: list[dict] = []
    stop = threading.Event()
    errors: list[str] = []

    def load() -> None:
        with srv.client(headers={"X-GR-API-Key": KEY}) as c:
            while not stop.is_set():
                try:
                    answers.append(generate(c, n=8))
                except AssertionError as exc:
                    errors.append(str(exc))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for path, items in (("v2.jsonl", v2), ("v3.jsonl", v3)):
            status = client.post("/catalog/reload", json={"path": str(root / path)}).json()
            by_version[status["version"]] = items
            deadline = time.monotonic() + 60
            while sum(1 for a in answers if a["catalog_version"] == status["version"]) < 3:
                if errors or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        back = client.post("/catalog/rollback").json()
        assert back["version"] == base + 1 and back["previous_version"] is None
        assert_error(client.post("/catalog/rollback"), 409, "conflict")
        count, deadline = len(answers), time.monotonic() + 60
        while len(answers) < count + 3 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    seen = {a["catalog_version"] for a in answers}
    assert {base + 1, base + 2} <= seen
    for meta in answers:
        check_items(meta, by_version[meta["catalog_version"]])


def test_reload_off_without_flag(tmp_path):
    write_catalog(tmp_path / "c.jsonl", 1, 50)
    with app_server() as srv, srv.client() as client:
        body = {"path": str(tmp_path / "c.jsonl")}
        assert_error(client.post("/catalog/reload", json=body), 403, "route_disabled")
        assert_error(client.post("/catalog/rollback"), 403, "route_disabled")
        assert client.get("/catalog/status").json()["loaded"] is False
        meta = generate(client)
        assert "item_results" not in meta and "catalog_version" not in meta


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, "9" * 30, 2**64 - 1])
def test_exclusions_past_int64_are_a_400(served, bad):
    """On an integer catalog (a string catalog spells "9" * 30 as an id like any other)."""
    _, client, root, _ = served
    reloaded = client.post("/catalog/reload", json={"path": str(root / "v1.jsonl")})
    assert reloaded.status_code == 200, reloaded.text  # earlier tests may leave another one
    for route in ("/generate", "/submit"):
        body = {"input_ids": [1, 7, 300], "sampling_params": {"n": 2, "exclude_item_ids": [1, bad]}}
        err = assert_error(client.post(route, json=body), 400, "validation_error")
        assert "int64" in err["message"] and len(err["message"]) < 200
    ok = {"input_ids": [1, 7, 300], "sampling_params": {"n": 2, "exclude_item_ids": [2**63 - 1]}}
    assert client.post("/generate", json=ok).status_code == 200  # the largest id is fine
