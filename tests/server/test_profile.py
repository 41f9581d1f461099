"""/start_profile and /stop_profile: torch's profiler over engine steps, traces in tmp_path; a real
server for the API key and GR_TORCH_PROFILER_DIR, the app in process for the rest."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest

from tests.support.appserver import app_server
from tests.support.serverproc import assert_error

pytestmark = pytest.mark.timeout(180)

KEY = "profile-key"
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}


def trace_ops(path: Path) -> set[str]:
    """The aten ops a Chrome trace recorded."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("aten::")}


def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no trace at {path}"
        time.sleep(0.05)


def test_profile_behind_the_key_into_the_configured_dir(start_server, tmp_path):
    srv = start_server("--api-key", KEY, env={"GR_TORCH_PROFILER_DIR": str(tmp_path / "traces")})
    with srv.client() as anonymous:
        assert_error(anonymous.post("/start_profile", json={}), 401, "unauthorized")
        assert_error(anonymous.post("/stop_profile", json={}), 401, "unauthorized")
    with srv.client(headers={"Authorization": f"Bearer {KEY}"}) as http:
        started = http.post("/start_profile", json={})
        assert started.status_code == 200, started.text
        path = Path(started.json()["trace_path"])
        assert path.parent == tmp_path / "traces" and path.name.endswith("-TP-0.trace.json.gz")
        assert_error(http.post("/start_profile", json={}), 409, "conflict")
        for _ in range(3):
            assert http.post("/generate", json=GENERATE).status_code == 200
        stopped = http.post("/stop_profile", json={})
        assert stopped.status_code == 200 and stopped.json()["trace_path"] == str(path)
        assert_error(http.post("/stop_profile", json={}), 409, "conflict")
    # The model's own ops, recorded in the engine's thread: a matmul and the attention.
    ops = trace_ops(path)
    assert {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"} & ops
    assert any("attention" in op or "softmax" in op for op in ops)


def test_bench_serving_body_stops_by_itself(tmp_path):
    """What `sglang.bench_serving --profile --profile-steps 2 --profile-start-step 1` sends
    (sglang/benchmark/serving.py L879-929): numbers as strings; no /stop_profile follows."""
    out = tmp_path / "bench" / "1767225600.0"
    body = {
        "activities": ["CPU", "GPU"],
        "num_steps": "2",
        "profile_by_stage": False,
        "profile_stages": None,
        "output_dir": str(out),
        "profile_prefix": None,
        "start_step": "1",
    }
    with app_server() as srv, srv.client() as http:
        started = http.post("/start_profile", json=body)
        assert started.status_code == 200, started.text
        path = Path(started.json()["trace_path"])
        for _ in range(3):
            http.post("/generate", json=GENERATE)
        wait_for(path)
        assert path.parent == out and trace_ops(path)
        # Finished by itself: a new profile starts, here by GET with the query and a prefix.
        again = http.get("/start_profile", params={"output_dir": str(out), "profile_prefix": "p"})
        assert again.status_code == 200 and Path(again.json()["trace_path"]).name.startswith("p-")
        assert http.get("/stop_profile").status_code == 200


def test_sglang_env_and_refusals(tmp_path):
    env = {"SGLANG_TORCH_PROFILER_DIR": str(tmp_path / "sglang")}
    with app_server(env=env) as srv, srv.client() as http:
        for body in (
            {"profile_by_stage": True},
            {"activities": ["RPD"]},
            {"num_steps": 0},
            {"profile_id": "../escape"},
            {"start_step": "soon"},
        ):
            assert_error(http.post("/start_profile", json=body), 400, "validation_error")
        started = http.post("/start_profile", json={"activities": ["CPU"], "with_stack": False})
        path = Path(started.json()["trace_path"])
        assert path.parent == tmp_path / "sglang"
        http.post("/generate", json=GENERATE)
        assert http.post("/stop_profile").json()["trace_path"] == str(path)
        assert trace_ops(path)


@pytest.mark.gpu
def test_gpu_activity_records_the_cuda_kernels(tmp_path):
    """On a CUDA server, activities GPU adds torch's CUDA activity: the trace holds the kernels
    the engine's steps launched, beside the CPU ops."""
    with app_server("--device", "cuda") as srv, srv.client() as http:
        body = {"output_dir": str(tmp_path), "activities": ["CPU", "GPU"], "num_steps": 3}
        started = http.post("/start_profile", json=body)
        assert started.status_code == 200, started.text
        path = Path(started.json()["trace_path"])
        for _ in range(3):
            assert http.post("/generate", json=GENERATE).status_code == 200
        wait_for(path)
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events) and trace_ops(path)


# ---- bounds: where a trace may go, how long a profile may grow, who writes the trace ----


def test_output_dir_is_confined_to_the_profile_dir(tmp_path):
    root, outside = tmp_path / "profiles", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "link").symlink_to(outside)
    with app_server("--torch-profiler-dir", str(root)) as srv, srv.client() as http:
        for output_dir in (
            str(outside),
            "/etc",
            "../outside",
            "a/../../outside",
            "link",
            "link/deeper",
            str(root / "link"),
            "a\x00b",
            "x" * 5000,
        ):
            body = {"output_dir": output_dir}
            assert_error(http.post("/start_profile", json=body), 400, "validation_error")
        long_id = {"profile_id": "p" * 300}
        err = assert_error(http.post("/start_profile", json=long_id), 400, "validation_error")
        assert "at most 128" in err["message"]
        assert_error(http.post("/stop_profile"), 409, "conflict")  # nothing was started
        inside = {"output_dir": "runs/a", "profile_id": "q" * 128, "num_steps": 1}
        started = http.post("/start_profile", json=inside)
        assert started.status_code == 200, started.text
        path = Path(started.json()["trace_path"])
        assert path.parent == root.resolve() / "runs" / "a"
        http.post("/generate", json=GENERATE)
        wait_for(path)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("bound", ["DEFAULT_STEPS", "MAX_SECONDS", "MAX_GROWTH_BYTES"])
def test_a_profile_started_with_nothing_stops_at_its_bounds(tmp_path, monkeypatch, bound):
    from grctl.engine import profiler

    # each bound made small in turn: steps 3, no time, memory below any growth
    monkeypatch.setattr(profiler, bound, {"DEFAULT_STEPS": 3}.get(bound, -1))
    with app_server("--torch-profiler-dir", str(tmp_path)) as srv, srv.client() as http:
        started = http.post("/start_profile", json={})
        assert started.status_code == 200, started.text
        path = Path(started.json()["trace_path"])
        for _ in range(4):
            assert http.post("/generate", json=GENERATE).status_code == 200
        wait_for(path)
        assert trace_ops(path)
        assert_error(http.post("/stop_profile"), 409, "conflict")  # it stopped by itself
        assert http.post("/start_profile", json={}).status_code in (200, 409)


def test_stop_exports_off_the_engine_thread(tmp_path, monkeypatch):
    """While /stop_profile writes a slow trace, a /generate is answered."""
    import threading

    from grctl.engine import profiler

    real, exporting, threads = profiler._export, threading.Event(), []

    def slow_export(prof, path):
        threads.append(threading.current_thread().name)
        exporting.set()
        time.sleep(3)
        return real(prof, path)

    monkeypatch.setattr(profiler, "_export", slow_export)
    with app_server("--torch-profiler-dir", str(tmp_path)) as srv, srv.client() as http:
        assert http.post("/start_profile", json={}).status_code == 200
        http.post("/generate", json=GENERATE)
        stop = threading.Thread(target=lambda: http.post("/stop_profile"))
        stop.start()
        assert exporting.wait(30)
        started = time.monotonic()
        assert http.post("/generate", json=GENERATE).status_code == 200
        took = time.monotonic() - started
        stop.join(30)
    assert took < 2.5, f"/generate waited {took:.1f} s for the export"
    assert threads and threads[0] != "grctl-engine"


@pytest.mark.slow
def test_resident_memory_comes_back_after_the_export(start_server, tmp_path):
    """Issue 32.5: a 30-step profile (with_stack, SGLang's default: every Python call) written
    through a real server: once its trace is written, the server's resident memory is back
    within 128 MiB of where it was before the profile (glibc kept the freed events: it stayed
    700 MiB-1 GiB up after 59 steps), and the trace holds the model's ops."""
    from tests.support.memory import rss

    batch = {"input_ids": [[1, 2, 3]] * 8, "sampling_params": {"max_new_tokens": 10, "n": 4}}
    srv = start_server("--torch-profiler-dir", str(tmp_path))
    with srv.client(timeout=300) as http:
        assert http.post("/generate", json=GENERATE).status_code == 200  # warm
        before = rss(srv.proc.pid)
        started = http.post("/start_profile", json={"num_steps": 1000})
        assert started.status_code == 200, started.text
        for _ in range(3):  # 3 requests of 10 steps
            assert http.post("/generate", json=batch).status_code == 200
        stopped = http.post("/stop_profile", json={})
        assert stopped.status_code == 200, stopped.text
        time.sleep(0.5)
        grown = rss(srv.proc.pid) - before
    assert {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"} & trace_ops(
        Path(stopped.json()["trace_path"])
    )
    assert grown < 128 << 20, f"resident memory {grown / 2**20:.0f} MiB up after the export"
