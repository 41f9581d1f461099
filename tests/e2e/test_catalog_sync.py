"""Weights and catalog as one sync on real servers: `grctl push --catalog` (a separate client
process) over the disk and tensor transports, with a fault at every step (GRCTL_FAULT_* hooks in
the servers). After each push the served tensors are checked against the checkpoint's own and
the served catalog against the file's items; a fault before the weights are written changes
nothing, one after leaves the server refusing to serve, saying why, until a catalog is
installed."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.support.checkpoints import write_checkpoint
from tests.support.cli import grctl
from tests.support.serverproc import assert_error
from tests.support.weight_helpers import checkpoint_sha256, served_sha256

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

LEVELS = (range(20, 28), range(40, 56), range(60, 100))
PROMPT = [3, 1, 4, 1, 5]


def write_items(path: Path, seed: int, num: int = 40) -> set[tuple[int, ...]]:
    rng = random.Random(seed)
    rows = [[rng.choice(level) for level in LEVELS] for _ in range(num)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"item_id": i, "token_ids": r}) + "\n" for i, r in enumerate(rows))
    )
    return {tuple(r) for r in rows}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("catalog-sync")
    out = {"root": root, "a": write_checkpoint(root / "a", seed=61)}
    out["b"] = write_checkpoint(root / "b", seed=62)
    out["faulty"] = root / "faulty" / "b"  # checkpoint reads fail here (mid-copy)
    shutil.copytree(out["b"], out["faulty"])
    out["items"] = {"a": write_items(root / "a.jsonl", 1), "b": write_items(root / "b.jsonl", 2)}
    for where in ("built", "written"):  # the sync fault hooks fire for catalogs under these
        (root / where).mkdir()
        shutil.copy(root / "b.jsonl", root / where / "b.jsonl")
    (root / "bad.jsonl").write_text('{"item_id": 1, "token_ids": [20, 40, 60]}\n{"item_id": 2}\n')
    return out


def serve_args(files) -> tuple[str, ...]:
    return (
        "--allow-weight-update",
        "--allow-catalog-reload",
        "--model-path",
        str(files["a"]),
        "--catalog",
        str(files["root"] / "a.jsonl"),
        "--weight-version",
        "a",
    )


@pytest.fixture(scope="module")
def srv(start_server, files):
    root = files["root"]
    env = {
        "GRCTL_FAULT_READ_ERROR_AFTER": "3",
        "GRCTL_FAULT_READ_ERROR_PATH": str(root / "faulty"),
        "GRCTL_FAULT_SYNC_ERROR_AT": "catalog_built",
        "GRCTL_FAULT_SYNC_ERROR_PATH": str(root / "built"),
    }
    return start_server(*serve_args(files), env=env)


@pytest.fixture(scope="module")
def late_srv(start_server, files):
    """A server whose syncs fail after the weights are written, before the catalog goes in."""
    env = {
        "GRCTL_FAULT_SYNC_ERROR_AT": "weights_written",
        "GRCTL_FAULT_SYNC_ERROR_PATH": str(files["root"] / "written"),
    }
    return start_server(*serve_args(files), env=env)


def push(url: str, ckpt: Path, catalog: Path, version: str, transport: str):
    return grctl(
        "push", "--checkpoint", str(ckpt), "--catalog", str(catalog), "--weight-version", version,
        "--transport", transport, "--url", url, "--json", "--no-verify", "--timeout", "120",
    )  # fmt: skip


def state(http) -> dict:
    return {
        "sums": served_sha256(http),
        "catalog": http.get("/catalog/status").json(),
        "version": http.get("/get_weight_version").json()["weight_version"],
    }


def constrained_item(http) -> tuple[int, ...]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return tuple(resp.json()["output_ids"])


def assert_serves(http, files, label: str) -> None:
    """The served tensors are the checkpoint's own, the catalog the file's, labelled alike."""
    assert served_sha256(http) == checkpoint_sha256(files[label])
    cat = http.get("/catalog/status").json()
    assert cat["source"].endswith(f"{label}.jsonl") and cat["weight_version"] == label, cat
    assert cat["num_items"] == len(files["items"][label])
    assert constrained_item(http) in files["items"][label]


@pytest.mark.parametrize(("transport", "label"), [("disk", "b"), ("tensor", "a"), ("auto", "b")])
def test_push_with_a_catalog_installs_both(srv, http, files, transport, label):
    before = http.get("/catalog/status").json()["version"]
    out = push(srv.url, files[label], files["root"] / f"{label}.jsonl", label, transport)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["ok"] is True
    assert_serves(http, files, label)
    assert http.get("/catalog/status").json()["version"] == before + 1


@pytest.mark.parametrize(
    ("catalog", "ckpt", "transport"),
    [
        ("bad.jsonl", "a", "disk"),  # the catalog does not load
        ("bad.jsonl", "a", "tensor"),
        ("built/b.jsonl", "a", "disk"),  # a fault right after it is built
        ("built/b.jsonl", "a", "tensor"),
    ],
)
def test_a_sync_refused_before_the_weights_changes_nothing(
    srv, http, files, catalog, ckpt, transport
):
    before = state(http)
    out = push(srv.url, files[ckpt], files["root"] / catalog, "x", transport)
    assert out.returncode == 1, out.stdout + out.stderr
    error = json.dumps(json.loads(out.stdout)["result"])
    assert "line 2" in error or "injected sync error" in error, error
    assert state(http) == before
    assert http.get("/ready").status_code == 200


def test_a_copy_failing_mid_way_leaves_the_catalog_and_refuses(srv, http, files):
    before = http.get("/catalog/status").json()
    out = push(srv.url, files["faulty"], files["root"] / "b.jsonl", "torn", "disk")
    assert out.returncode == 1
    assert http.get("/catalog/status").json() == before
    ready = http.get("/ready")
    assert ready.status_code == 503 and "weights_inconsistent" in ready.json()["reasons"]
    out = push(srv.url, files["b"], files["root"] / "b.jsonl", "b", "disk")  # repairs both
    assert out.returncode == 0, out.stdout + out.stderr
    assert_serves(http, files, "b")


def test_a_fault_after_the_weights_refuses_until_a_catalog_is_installed(late_srv, files):
    with late_srv.client(timeout=120) as http:
        before = http.get("/catalog/status").json()
        out = push(late_srv.url, files["b"], files["root"] / "written" / "b.jsonl", "b", "disk")
        assert out.returncode == 1
        assert "could not be installed" in out.stdout, out.stdout
        # the weights are b's, the catalog still a's: nothing is served from the pair
        assert served_sha256(http) == checkpoint_sha256(files["b"])
        assert http.get("/catalog/status").json() == before
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["reasons"][0] == "catalog_inconsistent"
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
        err = assert_error(http.post("/generate", json=body), 503, "weights_inconsistent")
        assert "written/b.jsonl" in err["message"] and "catalog" in err["message"]
        assert http.post("/continue_generation").status_code == 409
        resp = http.post("/catalog/reload", json={"path": str(files["root"] / "b.jsonl")})
        assert resp.status_code == 200, resp.text
        assert http.post("/continue_generation").status_code == 200
        assert_serves(http, files, "b")


def test_catalog_path_needs_catalog_reloads(start_app, files):
    app = start_app("--allow-weight-update", "--model-path", str(files["a"]))
    with app.client() as http:
        body = {"model_path": str(files["b"]), "catalog_path": str(files["root"] / "b.jsonl")}
        assert_error(http.post("/update_weights_from_disk", json=body), 403, "route_disabled")
        resp = http.post("/begin_weight_update", json={"catalog_path": "x"})
        assert_error(resp, 403, "route_disabled")
        assert served_sha256(http) == checkpoint_sha256(files["a"])
