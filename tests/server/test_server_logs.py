"""The server's own log, read from a real server's output: one line per weight update, pause,
continue, refusal and auth failure; --log-format json|text and --log-level; never the API key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.serverproc import REPO_ROOT, running_server

pytestmark = pytest.mark.timeout(240)
KEY = "s3cret-key-never-logged"


def events(log_text: str) -> list[dict]:
    """Every JSON log line (the server writes nothing else in json format but tracebacks)."""
    out = []
    for line in log_text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def wait_for(srv, pred, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in events(srv.log_text()) if pred(e)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_json_log_of_a_push_pause_refusal_and_auth_failure(tiny_checkpoint):
    args = ("--allow-weight-update", "--api-key", KEY, "--log-format", "json")
    with running_server(*args, "--model-path", str(tiny_checkpoint)) as srv:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GR_API_KEY": KEY}
        push = subprocess.run(
            [sys.executable, "-m", "grctl", "push", "--url", srv.url, "--checkpoint",
             str(tiny_checkpoint), "--weight-version", "v7", "--bucket-mb", "0.01"],
            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120,
        )  # fmt: skip
        assert push.returncode == 0, push.stderr
        with srv.client(headers={"X-GR-API-Key": KEY}) as http:
            assert http.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
        with srv.client(headers={"X-GR-API-Key": "wrong-" + KEY}) as http:
            assert http.get("/status").status_code == 403
        with srv.client() as http:
            assert http.get("/status").status_code == 401

        updates = wait_for(srv, lambda e: e.get("event") == "weight_update")
        assert updates and all(u["transport"] == "tensor" for u in updates)
        assert all(u["version"] == "v7" and u["tensors"] > 0 and u["bytes"] > 0 for u in updates)
        assert all(isinstance(u["ms"], (int, float)) and u["level"] == "INFO" for u in updates)
        assert sum(u["tensors"] for u in updates) >= 20  # the whole checkpoint, bucket by bucket
        by_event = {e.get("event") for e in events(srv.log_text())}
        assert {"pause", "continue"} <= by_event
        pause = wait_for(srv, lambda e: e.get("event") == "pause")[0]
        assert pause["mode"] == "abort" and "aborted" in pause
        refused = wait_for(srv, lambda e: e.get("event") == "refused")
        assert any(r["code"] == "validation_error" and r["status"] == 400 for r in refused)
        assert all(r["path"] and r["method"] for r in refused)
        auth = wait_for(srv, lambda e: e.get("event") == "auth_failure")
        assert sorted(a["code"] for a in auth) == ["forbidden", "unauthorized"]
        assert all(a["client"] == "127.0.0.1" and a["path"] == "/status" for a in auth)
        assert KEY not in srv.log_text()


@pytest.mark.slow
def test_text_log_and_level(tiny_checkpoint):
    args = ("--allow-weight-update", "--log-level", "warning", "--log-format", "text")
    with running_server(*args, env={"GR_LOG_LEVEL": "debug"}) as srv, srv.client() as http:
        assert http.post("/pause_generation", json={}).status_code == 200
        assert http.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
        assert http.post("/continue_generation").status_code == 200
        deadline = time.monotonic() + 10
        while "refused" not in srv.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = srv.log_text()
        line = next(ln for ln in text.splitlines() if " refused " in ln)
        assert "WARNING" in line and "code=validation_error" in line and "status=400" in line
        assert " pause " not in text and "serving model" not in text  # info is below warning
    with running_server("--allow-weight-update", env={"GR_LOG_FORMAT": "json"}) as srv:
        with srv.client() as http:
            assert http.post("/pause_generation", json={}).status_code == 200
        assert wait_for(srv, lambda e: e.get("event") == "pause")
