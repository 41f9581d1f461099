"""`grctl serve`: flags and GR_* variables into ServeConfig, --help, and SIGTERM draining."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

import grctl.server.serve as serve_module
from grctl.cli import app
from grctl.config import ServeConfig
from grctl.engine.config import EngineConfig
from grctl.errors import ValidationError
from grctl.knobs import env_name, flag_name, knobs_of
from tests.support.cli import cli_env, grctl
from tests.support.serverproc import REPO_ROOT, running_server

ENGINE_FIELDS = {f.name for f, _ in knobs_of(EngineConfig)}

# Every flag `grctl serve` had before its options were derived from the knobs: all still work.
FLAGS = [
    "--model-path", "--host", "--port", "--device", "--dtype", "--api-key",
    "--max-http-request-bytes", "--max-http-submit-many", "--max-running-requests",
    "--max-waiting-requests", "--max-context-len", "--max-beam-width", "--max-new-tokens",
    "--enable-prefill-cache", "--prefill-cache-max-entries", "--prefill-cache-max-tokens",
    "--cuda-graph", "--no-cuda-graph", "--allow-weight-update", "--weight-version",
    "--weights-root", "--log-requests", "--generate-timeout-s",
]  # fmt: skip


@pytest.fixture
def captured(monkeypatch) -> list[ServeConfig]:
    seen: list[ServeConfig] = []
    monkeypatch.setattr(serve_module, "serve", seen.append)
    return seen


def serve_help(columns: int) -> str:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


def test_help_at_80_columns_shows_every_flag_whole():
    out = serve_help(80)
    assert max(len(line) for line in out.splitlines()) <= 80
    tokens = set(re.findall(r"--[a-z0-9-]+", out))  # a cut name ends in "…", not in a letter
    for f, _ in ServeConfig.knobs():
        assert flag_name(f.name) in tokens, f"{flag_name(f.name)} is cut or missing"
    assert set(FLAGS) <= tokens
    assert "…" not in out
    assert "GR_<FLAG>" in out and "GR_MAX_RUNNING_REQUESTS" in out and "GR_HTTP_API_KEY" in out


def test_every_flag_reads_gr_flag(captured):
    """The help's rule, checked flag by flag: GR_ + the flag's name in capitals sets it."""
    for f, k in ServeConfig.knobs():
        var = "GR_" + flag_name(f.name)[2:].upper().replace("-", "_")
        assert env_name(f.name) == var
        value = {bool: "0" if f.default else "1", int: "7", float: "7.5"}.get(type(f.default))
        value = value or (k.choices[-1] if k.choices else "/x")
        captured.clear()
        result = CliRunner().invoke(app, ["serve"], env={var: value})
        assert result.exit_code == 0, (var, result.output)
        cfg = captured[0]
        got = getattr(cfg.engine if hasattr(cfg.engine, f.name) else cfg, f.name)
        assert got != f.default, f"{var}={value} left {f.name} at its default"


@pytest.mark.parametrize(
    ("env", "field", "want"),
    [
        ({"GR_API_KEY": "new"}, "api_key", "new"),
        ({"GR_HTTP_API_KEY": "old"}, "api_key", "old"),
        ({"GR_API_KEY": "new", "GR_HTTP_API_KEY": "old"}, "api_key", "new"),
        ({"GR_USE_CUDA_GRAPH": "0"}, "cuda_graph", False),
        ({"GR_CUDA_GRAPH": "false"}, "cuda_graph", False),
        ({"GR_ENABLE_PREFILL_CACHE": "0"}, "enable_prefill_cache", False),
        ({"GR_ENABLE_PREFILL_CACHE": "true"}, "enable_prefill_cache", True),
    ],
)
def test_env_names_and_old_aliases(captured, env, field, want):
    result = CliRunner().invoke(app, ["serve"], env=env)
    assert result.exit_code == 0, result.output
    cfg = captured[0]
    assert getattr(cfg.engine if field in ENGINE_FIELDS else cfg, field) == want


@pytest.mark.parametrize("flag", ["--disable-radix-cache", "--no-enable-prefill-cache"])
def test_prefix_cache_is_on_unless_switched_off(captured, flag):
    """On by default, as SGLang's radix cache; its off switches are SGLang's flag and ours."""
    for args, want in ((["serve"], True), (["serve", flag], False)):
        captured.clear()
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert captured[0].engine.enable_prefill_cache is want


def test_flags_and_env_build_the_config(captured):
    env = {"GR_PORT": "9123", "GR_HTTP_API_KEY": "k", "GR_ALLOW_WEIGHT_UPDATE": "1"}
    args = ["serve", "--max-http-submit-many", "7", "--weight-version", "3", "--log-requests"]
    args += ["--max-new-tokens", "5", "--no-cuda-graph", "--enable-prefill-cache"]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert cfg.port == 9123 and cfg.api_key == "k" and cfg.allow_weight_update is True
    assert cfg.max_http_submit_many == 7 and cfg.log_requests
    assert cfg.engine == EngineConfig(
        weight_version="3", max_new_tokens=5, cuda_graph=False, enable_prefill_cache=True
    )
    assert cfg.host == "127.0.0.1" and cfg.max_http_request_bytes == 1 << 20
    assert cfg.engine.model_path is None and cfg.url == "http://127.0.0.1:9123"


@pytest.mark.parametrize(
    ("text", "want"),
    [("8GiB", 8 << 30), ("512mib", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096)],
)
def test_byte_sizes_take_suffixes(captured, text, want):
    result = CliRunner().invoke(app, ["serve", "--max-kv-bytes", text])
    assert result.exit_code == 0, result.output
    assert captured[0].engine.max_kv_bytes == want
    result = CliRunner().invoke(app, ["serve"], env={"GR_MAX_CATALOG_BYTES": text})
    assert result.exit_code == 0 and captured[1].max_catalog_bytes == want


@pytest.mark.parametrize("text", ["8 parsecs", "GiB", "-1GiB", "1e9"])
def test_a_bad_byte_size_is_a_usage_error(captured, text):
    result = CliRunner().invoke(app, ["serve", "--max-kv-bytes", text])
    assert result.exit_code == 2 and "not a byte size" in result.output, result.output
    assert not captured


def test_sglang_flag_names_set_the_same_knobs(captured):
    args = ["serve", "--max-queued-requests", "77", "--max-prefill-tokens", "2048"]
    args += ["--enable-deterministic-inference"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    engine = captured[0].engine
    assert engine.max_waiting_requests == 77 and engine.prefill_token_budget == 2048
    assert engine.deterministic_inference is True
    # the aliases are documented beside grctl's names
    doc = (REPO_ROOT / "docs" / "cli.md").read_text()
    for sglang, ours in (("--max-queued-requests", "--max-waiting-requests"),
                         ("--max-prefill-tokens", "--prefill-token-budget")):  # fmt: skip
        assert f"| `{ours}` | `{sglang}` |" in doc


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("serve.yaml", "max-kv-bytes: 8GiB\nport: 9191\ncuda_graph: false\nweight-version: v7\n"),
        ("serve.toml", 'max-kv-bytes = "8GiB"\nport = 9191\ncuda_graph = false\n'
                       'weight-version = "v7"\n'),
    ],
)  # fmt: skip
def test_config_file_sets_flags_and_the_command_line_wins(captured, tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    result = CliRunner().invoke(app, ["serve", "--config", str(path)])
    assert result.exit_code == 0, result.output
    cfg = captured[0]
    assert cfg.port == 9191 and cfg.engine.max_kv_bytes == 8 << 30
    assert cfg.engine.cuda_graph is False and cfg.engine.weight_version == "v7"
    result = CliRunner().invoke(
        app, ["serve", "--config", str(path), "--port", "9000"], env={"GR_WEIGHT_VERSION": "e"}
    )
    assert result.exit_code == 0, result.output
    assert captured[1].port == 9000 and captured[1].engine.weight_version == "e"
    assert captured[1].engine.max_kv_bytes == 8 << 30


@pytest.mark.parametrize(
    ("text", "needle"),
    [("max-kv-byte: 1\n", "unknown flag 'max-kv-byte'"), ("- 1\n", "must map flag names")],
)
def test_a_bad_config_file_is_a_usage_error(captured, tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["serve", "--config", str(path)], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and needle in result.output, result.output
    assert not captured


def test_flag_beats_env_and_defaults(captured):
    result = CliRunner().invoke(app, ["serve", "--port", "8001"], env={"GR_PORT": "9000"})
    assert result.exit_code == 0 and captured[0].port == 8001
    assert captured[0] == ServeConfig(port=8001)


def test_config_validation():
    assert env_name("api_key") == "GR_API_KEY" and env_name("port") == "GR_PORT"
    with pytest.raises(ValidationError, match="dtype"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValidationError, match="max_http_submit_many"):
        ServeConfig(max_http_submit_many=0)
    with pytest.raises(ValidationError, match="max_beam_width"):
        EngineConfig(max_beam_width=0)
    with pytest.raises(ValidationError, match="port"):
        ServeConfig(port=70000)
    assert ServeConfig(api_key="").api_key is None


def test_bad_value_is_a_usage_error():
    result = CliRunner().invoke(app, ["serve", "--max-beam-width", "0"])
    assert result.exit_code == 2 and "--max-beam-width" in result.output


def test_bad_flag_is_one_red_line():
    proc = subprocess.run(
        [sys.executable, "-m", "grctl", "serve", "--dtype", "int8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "unsupported dtype 'int8'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", [["serve"], ["push"], ["catalog", "rollback"]])
def test_help_shows_bool_flags_as_flags_and_keeps_brackets(command):
    out = grctl(*command, "--help")
    assert out.returncode == 0, out.stderr
    assert "<bool>" not in out.stdout, out.stdout  # typer 0.29 shows one beside every flag
    if command == ["serve"]:
        assert "--cuda-graph" in out.stdout and "[beams, vocab]" in out.stdout  # not eaten


def test_short_version_and_shell_completion():
    assert grctl("-V").stdout.strip() == grctl("--version").stdout.strip() != ""
    out = grctl("--show-completion", "bash")
    assert out.returncode == 0 and "_GRCTL_COMPLETE" in out.stdout, out.stdout + out.stderr


def test_a_taken_port_is_one_red_line_and_exit_1():
    """uvicorn found the port taken only after start-up and exited 3 without an error line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "grctl", "serve", "--device", "cpu", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            env=cli_env(),
        )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: cannot listen on 127.0.0.1:{port}: the port is taken (choose another "
                     "--port, or stop what listens there)"], proc.stderr  # fmt: skip


def test_context_longer_than_the_checkpoint_is_one_red_line():
    proc = subprocess.run(
        [sys.executable, "-m", "grctl", "serve", "--max-context-len", "9000", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "--max-context-len 9000 is longer than the checkpoint's 8192 positions" in proc.stderr


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
