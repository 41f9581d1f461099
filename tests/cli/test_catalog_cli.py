"""`grctl catalog ...` as an operator runs it, and GRClient's typed item results."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grctl.cli import app
from grctl.client import GRClient
from grctl.protocol.catalog import ItemResultOut
from tests.support.catalogs import write_catalog
from tests.support.cli import grctl
from tests.support.serverproc import free_port, running_server

pytestmark = pytest.mark.timeout(180)


def validate(*args: str):
    result = CliRunner().invoke(app, ["catalog", "validate", *args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_validate_counts_depths_collisions_and_shadowed(tmp_path):
    rows = [
        {"item_id": "a", "token_ids": [5, 6]},
        {"item_id": "b", "token_ids": [5, 6, 7]},  # extends a's path: a beam stops at a first
        {"item_id": "c", "token_ids": [5, 6, 7]},  # collides with b
        {"item_id": "d", "token_ids": [9], "metadata": {"title": "x"}},
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, report = validate(str(path), "--vocab-size", "10")
    assert code == 0 and report["ok"] is True
    assert report["num_items"] == 4 and report["num_paths"] == 3 and report["max_depth"] == 3
    assert report["depth_histogram"] == {"1": 1, "2": 1, "3": 2}
    assert report["num_collision_paths"] == 1 and report["num_collision_items"] == 2
    assert report["num_shadowed_items"] == 2 and report["num_items_out_of_range"] == 0
    code, report = validate(str(path), "--vocab-size", "8")
    assert code == 1 and report["num_items_out_of_range"] == 1
    assert "line 4: token id 9" in report["error"]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 9}))
    code, report = validate(str(path), "--model-path", str(tmp_path / "model"))
    assert code == 1 and report["vocab_size"] == 9
    # a --model-path without config.json: the JSON report says so (it printed nothing)
    code, report = validate(str(path), "--model-path", str(tmp_path / "nowhere"))
    assert code == 1 and report["ok"] is False and "config.json" in report["error"], report


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "cannot be read"),
        ('{"item_id": 1, "token_ids": [1]}\n[1, 2]\n', "line 2"),
        ('{"item_id": 1}\n', "line 1"),
        ("", "no items"),
        ('{"item_id": 1, "token_ids": []}\n', "line 1: an empty token_ids"),
    ],
)
def test_validate_bad_files_exit_1(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    code, report = validate(str(path))
    assert code == 1 and report["ok"] is False and needle in report["error"]


def test_validate_table_shows_messages_verbatim(tmp_path):
    """Messages hold brackets ('[int, ...]'): the human table prints them, not as Rich markup."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"item_id": 1}\n')
    result = CliRunner().invoke(app, ["catalog", "validate", str(path)], terminal_width=200)
    assert result.exit_code == 1
    assert '"token_ids": [int, ...]' in result.stdout


def reply(out) -> dict:
    return json.loads(out.stdout)["servers"][0]["reply"]


@pytest.mark.slow
def test_status_reload_rollback_json_and_typed_client(tmp_path):
    v1 = write_catalog(tmp_path / "v1.jsonl", 1, 400)
    v2 = write_catalog(tmp_path / "v2.jsonl", 2, 50, codes=8, id_prefix="b")
    with running_server("--catalog", str(tmp_path / "v1.jsonl"), "--allow-catalog-reload") as srv:
        url = ["--url", srv.url]
        out = grctl("catalog", "status", *url, "--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)  # the shared --json document (grctl/cli/output.py)
        assert doc["command"] == "catalog status" and doc["ok"] is True
        status = doc["servers"][0]["reply"]
        assert status["version"] == 1 and status["num_items"] == 400
        with GRClient(srv.url) as gr:
            res = gr.generate([1, 2, 3], max_new_tokens=3, n=3)
            assert res.meta_info.catalog_version == 1 and len(res.meta_info.item_results) == 3
            for row in res.meta_info.item_results:
                assert isinstance(row, ItemResultOut) and row.is_complete
                assert row.item_ids == v1[tuple(row.token_ids)] and row.item_id == row.item_ids[0]
            free = gr.generate([1, 2, 3], max_new_tokens=3, n=3, use_catalog=False)
            assert free.meta_info.item_results is None and free.meta_info.catalog_version is None
            out = grctl("catalog", "reload", str(tmp_path / "v2.jsonl"), *url, "--json")
            assert out.returncode == 0 and reply(out)["version"] == 2
            res = gr.generate([1, 2, 3], max_new_tokens=3, n=2)
            assert res.meta_info.catalog_version == 2
            assert all(r.item_ids == v2[tuple(r.token_ids)] for r in res.meta_info.item_results)
            out = grctl("catalog", "rollback", *url, "--json")
            assert out.returncode == 0 and reply(out)["version"] == 1
            assert gr.catalog_status().version == 1
        out = grctl("catalog", "rollback", *url, "--json")
        assert out.returncode == 1 and "no previous catalog" in out.stderr
        failed = json.loads(out.stdout)["servers"][0]
        assert failed["ok"] is False and "no previous catalog" in failed["error"]["message"]
        out = grctl("catalog", "reload", str(tmp_path / "missing.jsonl"), *url)
        assert out.returncode == 1 and "cannot be read" in out.stderr
        out = grctl("catalog", "status", *url)  # the table, for people
        assert out.returncode == 0 and "v1.jsonl" in out.stdout
        out = grctl("status", *url)  # the server's compact view names its catalog
        assert out.returncode == 0 and "catalog" in out.stdout and "400 items" in out.stdout


def tiny_items(path, seed: int, num: int = 30) -> set[tuple[int, ...]]:
    """A catalog of 3-token items inside the tiny checkpoint's vocabulary (128)."""
    rng = random.Random(seed)
    rows = {tuple(rng.randrange(lo, lo + 30) for lo in (10, 45, 80)) for _ in range(num)}
    lines = [json.dumps({"item_id": f"{seed}-{i}", "token_ids": r}) for i, r in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return rows


def test_rollback_after_a_push_with_its_catalog_needs_force(tmp_path, checkpoint):
    """A push with --catalog installs weights b with catalog b: rolling the catalog back alone
    would serve b's weights with a's items, so it is a 409 (nothing changes) unless forced."""
    items = {k: tiny_items(tmp_path / f"{k}.jsonl", seed) for k, seed in (("a", 1), ("b", 2))}
    items["c"] = tiny_items(tmp_path / "c.jsonl", 3)
    flags = ("--allow-catalog-reload", "--allow-weight-update", "--weight-version", "a")
    model = ("--model-path", str(checkpoint(seed=0)), "--catalog", str(tmp_path / "a.jsonl"))
    with running_server(*flags, *model) as srv, GRClient(srv.url) as gr:
        url = ["--url", srv.url]

        def served() -> tuple[str, str | None, tuple[int, ...]]:
            status = gr.catalog_status()
            out = gr.generate([3, 1, 4], max_new_tokens=3)
            return Path(status.source).stem, status.weight_version, tuple(out.output_ids)

        args = ["--checkpoint", str(checkpoint(seed=1)), "--catalog", str(tmp_path / "b.jsonl")]
        out = grctl("push", *args, "--weight-version", "b", "--no-verify", *url, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        source, label, item = served()
        assert (source, label) == ("b", "b") and item in items["b"]
        out = grctl("catalog", "rollback", *url, "--json")
        assert out.returncode == 1, out.stdout
        error = json.loads(out.stdout)["servers"][0]["error"]
        assert error["status"] == 409 and error["code"] == "conflict", error
        assert "other weights" in error["message"] and "--force" in error["message"]
        assert served()[:2] == ("b", "b") and gr.catalog_status().num_rollbacks == 0
        out = grctl("catalog", "rollback", "--force", *url, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        source, label, item = served()  # a's items with b's weights, as asked: labelled so
        assert (source, label) == ("a", "b") and item in items["a"]
        assert gr.get_weight_version().weight_version == "b"
        # a reload under the same weights rolls back without force
        assert grctl("catalog", "reload", str(tmp_path / "c.jsonl"), *url).returncode == 0
        assert served()[0] == "c"
        assert grctl("catalog", "rollback", *url).returncode == 0
        source, label, item = served()
        assert (source, label) == ("a", "b") and item in items["a"]


def test_serve_refuses_a_bad_catalog_at_start(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"item_id": 1, "token_ids": [300]}\n{"item_id": 2, "token_ids": [9999]}\n')
    out = grctl("serve", "--port", str(free_port()), "--device", "cpu", "--catalog", str(bad))
    assert out.returncode == 1 and "line 2: token id 9999" in out.stderr
