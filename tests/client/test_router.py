"""Scale-out behind SGLang's own router (sglang-router, `pip install grctl[router]`).

Two replicas join a real router with --router-url; /generate goes through the router while a
fleet push finds the replicas from the router's worker list and syncs them. Every answer that
comes back 200 is checked against transformers' greedy output of the version it names (an
answer ended by the push's pause must be a prefix of it); the only other answer allowed is the
pause's 503. A replica that stops leaves the router's list; one whose router restarts (and
forgets its workers) joins it again. Skipped when sglang_router is not installed.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from grctl.client import WeightSync
from grctl.client.router import list_workers
from tests.support.reference import hf_generate
from tests.support.serverproc import free_port, running_server

pytest.importorskip("sglang_router")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PROMPT = [1, 5, 9, 42, 7]
NEW_TOKENS = 4


@contextmanager
def running_router(log_path, port: int | None = None):
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--policy", "round_robin", "--log-level", "warn"]
    cmd += ["--prometheus-port", str(free_port())]  # not the shared default 29000
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        # up = it answers its worker list; a replica already polling it may join at once, so
        # the list need not be empty by the first answer
        try:
            wait_for(lambda: isinstance(list_workers(url), list), 60, "the router up")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; its log: {log_path.read_text()[-3000:]!r}") from None
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def healthy_urls(router_url: str) -> set[str]:
    return {w["url"] for w in list_workers(router_url) if w.get("is_healthy")}


def served_new(answers: list[tuple[int, dict]]) -> int:
    return sum(1 for s, b in list(answers) if s == 200 and b["meta_info"]["weight_version"] == "1")


def test_fleet_push_through_the_router_under_traffic(tmp_path, tiny_checkpoint, checkpoint):
    seed1 = checkpoint(seed=1)
    want = {
        "default": hf_generate(tiny_checkpoint, PROMPT, NEW_TOKENS),
        "1": hf_generate(seed1, PROMPT, NEW_TOKENS),
    }
    with ExitStack() as stack:
        router = stack.enter_context(running_router(tmp_path / "router.log"))
        flags = ("--model-path", str(tiny_checkpoint), "--allow-weight-update")
        replicas = [
            stack.enter_context(running_server(*flags, "--router-url", router)) for _ in range(2)
        ]
        urls = {r.url for r in replicas}
        wait_for(lambda: healthy_urls(router) == urls, 60, "both replicas registered")

        answers: list[tuple[int, dict]] = []
        stop = threading.Event()

        def traffic() -> None:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS}}
            with httpx.Client(base_url=router, timeout=60) as http:
                while not stop.is_set():
                    resp = http.post("/generate", json=body)
                    answers.append((resp.status_code, resp.json() if resp.content else {}))

        worker = threading.Thread(target=traffic)
        worker.start()
        try:
            wait_for(lambda: len(answers) >= 4, 60, "traffic before the push")
            before = list(answers)
            with WeightSync(router=router, bucket_mb=0.01, verify=True) as sync:
                result = sync.run(seed1, weight_version="1")
            assert {o.url for o in result.servers} == urls and result.ok
            # answers on the new weights (the push may start well after `before`: its shm
            # manager starts before the pause, so more old answers can come first)
            wait_for(lambda: len(answers) >= len(before) + 6 and served_new(answers) >= 4, 60,
                     "traffic after the push")  # fmt: skip
        finally:
            stop.set()
            worker.join(120)

        versions = []
        for status, body in answers:
            if status != 200:
                assert status == 503 and body["error"]["code"] == "paused", (status, body)
                continue
            meta = body["meta_info"]
            versions.append(meta["weight_version"])
            full = want[meta["weight_version"]]
            if meta["finish_reason"]["type"] == "abort":
                assert body["output_ids"] == full[: len(body["output_ids"])]
            else:
                assert body["output_ids"] == full, meta
        assert versions[0] == "default" and versions[-1] == "1"
        assert versions.count("1") >= 4, [a[0] for a in answers]

        replicas[0].proc.terminate()  # a replica that stops leaves the router
        replicas[0].proc.wait(30)
        wait_for(
            lambda: {w["url"] for w in list_workers(router)} == {replicas[1].url},
            30,
            "the stopped replica to leave the router",
        )
        assert "left the router" in replicas[0].log_text()


def test_a_replica_joins_a_restarted_router_again(tmp_path, tiny_checkpoint):
    """sglang-router keeps its worker list in memory: after a restart it lists nobody, and the
    replica, checking every --router-check-interval, registers again and says so in its log."""
    port = free_port()
    flags = ("--model-path", str(tiny_checkpoint), "--router-check-interval", "0.5")
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS}}
    want = hf_generate(tiny_checkpoint, PROMPT, NEW_TOKENS)
    with ExitStack() as stack:
        with running_router(tmp_path / "router1.log", port) as router:
            replica = stack.enter_context(running_server(*flags, "--router-url", router))
            wait_for(lambda: healthy_urls(router) == {replica.url}, 60, "the replica registered")
        # the router is gone: the replica serves on and logs the outage once
        wait_for(lambda: "could not check the router" in replica.log_text(), 30, "the outage")
        with running_router(tmp_path / "router2.log", port) as router:
            wait_for(lambda: healthy_urls(router) == {replica.url}, 60, "the replica re-joined")
            with httpx.Client(base_url=router, timeout=60) as http:
                resp = http.post("/generate", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["output_ids"] == want
            log = replica.log_text()
        assert "no longer listed this server" in log and "joined it again" in log, log[-3000:]
        assert log.count("could not check the router") == 1, log  # once per outage
        assert "httpx" not in log  # the checks themselves are not logged
