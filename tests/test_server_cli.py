"""`grctl serve`: flags and GR_* variables into ServeConfig, --help, and SIGTERM draining."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

import grctl.server.serve as serve_module
from grctl.cli import app
from grctl.config import ServeConfig, env_var
from grctl.errors import ValidationError
from tests.serverproc import running_server

FLAGS = [
    "--model-path", "--host", "--port", "--device", "--dtype", "--api-key",
    "--max-http-request-bytes", "--max-http-submit-many", "--max-waiting-requests",
    "--max-context-len", "--enable-prefill-cache", "--prefill-cache-max-entries",
    "--prefill-cache-max-tokens", "--allow-weight-update", "--weight-version", "--log-requests",
]  # fmt: skip


@pytest.fixture
def captured(monkeypatch) -> list[ServeConfig]:
    seen: list[ServeConfig] = []
    monkeypatch.setattr(serve_module, "serve", seen.append)
    return seen


def test_help_explains_every_flag():
    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for flag in FLAGS:
        assert flag in out, flag
    assert "GR_HTTP_API_KEY" in out and "GR_ALLOW_WEIGHT_UPDATE" in out


def test_flags_and_env_build_the_config(captured):
    env = {"GR_PORT": "9123", "GR_HTTP_API_KEY": "k", "GR_ALLOW_WEIGHT_UPDATE": "1"}
    args = ["serve", "--max-http-submit-many", "7", "--weight-version", "3", "--log-requests"]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert cfg.port == 9123 and cfg.api_key == "k" and cfg.allow_weight_update is True
    assert cfg.max_http_submit_many == 7 and cfg.weight_version == "3" and cfg.log_requests
    assert cfg.host == "127.0.0.1" and cfg.max_http_request_bytes == 1 << 20
    assert cfg.model_path is None and cfg.url == "http://127.0.0.1:9123"


def test_flag_beats_env_and_defaults(captured):
    result = CliRunner().invoke(app, ["serve", "--port", "8001"], env={"GR_PORT": "9000"})
    assert result.exit_code == 0 and captured[0].port == 8001
    assert captured[0] == ServeConfig(port=8001)


def test_config_validation():
    assert env_var("api_key") == "GR_HTTP_API_KEY" and env_var("port") == "GR_PORT"
    with pytest.raises(ValidationError, match="dtype"):
        ServeConfig(dtype="int8")
    with pytest.raises(ValidationError, match="max_http_submit_many"):
        ServeConfig(max_http_submit_many=0)
    assert ServeConfig(api_key="").api_key is None


def test_bad_flag_is_one_red_line():
    proc = subprocess.run(
        [sys.executable, "-m", "grctl", "serve", "--dtype", "int8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "unsupported dtype 'int8'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_sigterm_drains_in_flight_requests():
    with running_server() as srv, srv.client() as http:
        body = {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 32, "n": 16}}
        replies: list = []
        t = threading.Thread(target=lambda: replies.append(http.post("/generate", json=body)))
        t.start()
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert replies and replies[0].status_code == 200, replies
        assert replies[0].json()["meta_info"]["finish_reason"]["type"] == "length"
        # uvicorn re-raises the signal once shut down, so the exit status says "SIGTERM".
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)
        assert "stopping: draining" in srv.log_text()
