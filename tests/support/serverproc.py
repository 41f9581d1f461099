"""Start a real `python -m grctl serve` on a free loopback port, for tests that need a server.

    with running_server("--allow-weight-update", "--model-path", str(ckpt)) as srv:
        httpx.get(srv.url + "/health")

The server's stdout and stderr go to a log file (srv.log_text(), readable until the block ends;
it is removed with its directory on exit, so tests leave nothing in /tmp); on exit the server
gets SIGTERM, then SIGKILL if it has not stopped within `stop_timeout` seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)


def wait_healthy(srv: ServerProc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(
                f"grctl serve exited with {srv.proc.returncode} before /health answered:\n"
                + srv.log_text()[-4000:]
            )
        try:
            if httpx.get(srv.url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"grctl serve not healthy after {timeout} s:\n" + srv.log_text()[-4000:])


def stop(srv: ServerProc, timeout: float) -> int:
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()
    return srv.proc.returncode


@contextmanager
def running_server(
    *args: str,
    env: dict[str, str] | None = None,
    start_timeout: float = 120.0,
    stop_timeout: float = 30.0,
    clean_env: bool = False,
) -> Iterator[ServerProc]:
    """Yield a started server; extra CLI flags in `args`, extra environment in `env` (with
    clean_env, `env` and PATH only, not this process's environment)."""
    port = free_port()
    cmd = [sys.executable, "-m", "grctl", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        cmd += ["--device", "cpu"]
    base = {"PATH": os.environ.get("PATH", "")} if clean_env else os.environ
    full_env = {**base, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p
    )
    with tempfile.TemporaryDirectory(prefix="grctl-serve-") as log_dir:  # removed on exit
        log_path = Path(log_dir) / f"serve-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*cmd, *args], stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO_ROOT
            )
        srv = ServerProc(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log_path)
        try:
            wait_healthy(srv, start_timeout)
            yield srv
        finally:
            stop(srv, stop_timeout)


def start_servers(stack: ExitStack, n: int, *args: str) -> list[ServerProc]:
    """n servers started side by side; each is stopped when the stack closes."""
    managers = [running_server(*args) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        servers = list(pool.map(lambda cm: cm.__enter__(), managers))
    for cm in managers:
        stack.push(cm.__exit__)
    return servers


def assert_error(resp: httpx.Response, status: int, code: str) -> dict:
    """The reply is protocol.md's error shape with this status and code; returns the error."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["code"] == code, err
    assert err["status"] == status and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["retryable"], bool)
    return err
