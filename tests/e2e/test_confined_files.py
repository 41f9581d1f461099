"""Files a request names are opened so that a symlink cannot carry a real server outside its
--weights-root or its profile directory (grctl/confined.py): a delta file or index that is a
symlink out of the root is refused in the error shape with the served weights unchanged
(their sha256); a marker of the local checkpoint replaced by a symlink is never written
through; a catalog symlink flipped between a file inside the root and one outside, while
reloads run, never gets the outside one served; a symlink planted at the profiler's old
predictable temporary name is not followed. Before, each of these read or wrote the file
outside."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time

import pytest

from tests.e2e.test_delta_sync import step
from tests.e2e.test_miles_delta import FILE, publish_like_miles
from tests.support.checkpoints import dir_tensors, write_checkpoint
from tests.support.serverproc import assert_error, running_server
from tests.support.weight_helpers import checkpoint_sha256, served_sums

INDEX = "model.safetensors.index.json"
MARK = ".grctl-local-version"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root, outside = tmp_path_factory.mktemp("confined"), tmp_path_factory.mktemp("outside")
    base = write_checkpoint(root / "base", seed=9)
    args = ["--allow-weight-update", "--model-path", str(base), "--weights-root", str(root),
            "--weight-version", "0", "--allow-catalog-reload",
            "--torch-profiler-dir", str(root / "profiles")]  # fmt: skip
    with running_server(*args) as srv:
        yield srv, root, outside, dir_tensors(base)


def linked_out(root, outside, state, name: str, link: str):
    """A version 1 published outside the root; inside it, its dir with `link` a symlink to the
    outside file and the other file copied."""
    publish_like_miles(outside / name, 1, state, step(state, seed=90), "xor")
    real, vdir = outside / name / "weight_v000001", root / name / "weight_v000001"
    vdir.mkdir(parents=True)
    for f in (INDEX, FILE):
        if f == link:
            (vdir / f).symlink_to(real / f)
        else:
            (vdir / f).write_bytes((real / f).read_bytes())
    return root / name


@pytest.mark.parametrize("link", [FILE, INDEX])
def test_a_delta_file_symlinked_out_of_the_root_is_refused(env, link):
    srv, root, outside, state = env
    src = linked_out(root, outside, state, f"pub-{link == INDEX}", link)
    before = served_sums(srv.url)
    r = srv.client().post("/pull_weights", json={"source_dir": str(src), "target_version": 1})
    assert "is a symlink" in assert_error(r, 400, "validation_error")["message"]
    assert served_sums(srv.url) == before
    # into a local checkpoint too: refused, the directory still version 0
    local, http = root / f"local-{link == INDEX}", srv.client()
    body = {"local_checkpoint_dir": str(local), "source_dir": str(src)}
    assert http.post("/pull_weights", json={**body, "target_version": 0}).status_code == 200
    r = http.post("/pull_weights", json={**body, "target_version": 1})
    assert "is a symlink" in assert_error(r, 400, "validation_error")["message"]
    assert (local / MARK).read_text() == "0"


def test_a_symlinked_marker_is_not_written_through(env):
    srv, root, outside, state = env
    http, pub, local = srv.client(), root / "pub-mark", root / "local-mark"
    body = {"local_checkpoint_dir": str(local), "source_dir": str(pub)}
    assert http.post("/pull_weights", json={**body, "target_version": 0}).status_code == 200
    publish_like_miles(pub, 1, state, step(state, seed=91), "xor")
    victim = outside / "victim-marker"
    victim.write_text("0")
    (local / MARK).unlink()
    (local / MARK).symlink_to(victim)
    r = http.post("/pull_weights", json={**body, "target_version": 1})
    assert "no seeded checkpoint" in assert_error(r, 409, "conflict")["message"]
    assert victim.read_text() == "0"
    # seeding again replaces the directory (the link goes with it, never followed)
    assert http.post("/pull_weights", json={**body, "target_version": 0}).status_code == 200
    assert http.post("/pull_weights", json={**body, "target_version": 1}).status_code == 200
    assert victim.read_text() == "0" and (local / MARK).read_text() == "1"
    assert not (local / MARK).is_symlink()


def catalog_lines(num: int, first: int) -> str:
    rows = [{"item_id": first + i, "token_ids": [3 + i % 50, 60 + i // 50]} for i in range(num)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_catalog_symlink_flipped_during_reloads_never_serves_outside(env):
    """The route checks the resolved path, the worker opens it later: a symlink flipped in
    between was served 3 times in 29 tries. The opened file is checked through its descriptor."""
    srv, root, outside, _ = env
    (root / "inside.jsonl").write_text(catalog_lines(5, 0))
    (outside / "outside.jsonl").write_text(catalog_lines(7, 100))
    link, stop = root / "catalog.jsonl", threading.Event()
    link.symlink_to(root / "inside.jsonl")

    def flip() -> None:
        targets, i = (outside / "outside.jsonl", root / "inside.jsonl"), 0
        while not stop.is_set():
            tmp = root / f".flip-{i}"
            tmp.symlink_to(targets[i % 2])
            os.replace(tmp, link)
            i += 1

    flipper = threading.Thread(target=flip)
    flipper.start()
    counts = {}
    try:
        with srv.client() as http:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and sum(counts.values()) < 200:
                r = http.post("/catalog/reload", json={"path": str(link)})
                key = r.json()["num_items"] if r.status_code == 200 else r.status_code
                counts[key] = counts.get(key, 0) + 1
    finally:
        stop.set()
        flipper.join()
    assert 7 not in counts, counts  # the outside catalog (7 items) was never served
    assert counts.get(5) and counts.get(403), counts  # both sides were hit
    assert set(counts) <= {5, 403}, counts


def test_a_symlink_at_the_profilers_temp_name_is_not_followed(env):
    srv, root, outside, _ = env
    victim = outside / "victim-trace"
    victim.write_bytes(b"not a trace")
    with srv.client() as http:
        r = http.post("/start_profile", json={"profile_id": "planted", "activities": ["CPU"]})
        assert r.status_code == 200, r.text
        trace = root / "profiles" / os.path.basename(r.json()["trace_path"])
        trace.parent.mkdir(parents=True, exist_ok=True)
        (trace.parent / f".{trace.name}.partial.json.gz").symlink_to(victim)
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        assert http.post("/generate", json=body).status_code == 200
        r = http.post("/stop_profile", json={})
        assert r.status_code == 200 and r.json()["trace_path"] == str(trace), r.text
    assert victim.read_bytes() == b"not a trace"
    assert not trace.is_symlink() and "traceEvents" in json.loads(
        gzip.decompress(trace.read_bytes())
    )
    left = [p.name for p in trace.parent.iterdir() if p.name.startswith(".")]
    assert left == [f".{trace.name}.partial.json.gz"], left  # only the planted link, untouched


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "torch"])
def test_a_checkpoint_file_symlinked_out_of_the_root_is_refused(env, safe):
    """The route checks model_path; its weight file may still be a symlink out of the root.
    A symlink that stays inside it (as the HF cache's snapshots name their blobs) is read."""
    srv, root, outside, _ = env
    name = "model.safetensors" if safe else "pytorch_model.bin"
    theirs = write_checkpoint(outside / f"ckpt-{safe}", seed=92, safe_serialization=safe)
    mine = root / f"escape-{safe}"
    mine.mkdir()
    (mine / "config.json").write_bytes((theirs / "config.json").read_bytes())
    (mine / name).symlink_to(theirs / name)
    before = served_sums(srv.url)
    with srv.client() as http:
        r = http.post("/update_weights_from_disk", json={"model_path": str(mine)})
        assert "outside the weights root" in assert_error(r, 403, "forbidden")["message"]
        assert served_sums(srv.url) == before
        blob = root / f"blobs-{safe}"
        blob.mkdir()
        (blob / "weights").write_bytes((theirs / name).read_bytes())
        (mine / name).unlink()
        (mine / name).symlink_to(blob / "weights")
        r = http.post("/update_weights_from_disk", json={"model_path": str(mine)})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert served_sums(srv.url) == checkpoint_sha256(theirs) != before
        base = root / "base"
        assert http.post("/update_weights_from_disk", json={"model_path": str(base)}).is_success
