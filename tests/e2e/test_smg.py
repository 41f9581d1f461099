"""A grctl fleet behind smg 1.13 (the gateway sglang-router became), driven through smg's RL
control plane (`--enable-rl`, `smg.rl`): two real servers, a real smg, the trainer's calls
through smg only.

What is held to an independent reference: every item list is transformers' exact ranking of
the catalog (three first tokens and a beam width of four make the constrained search
exhaustive, so the best four items by summed log-probability are the answer), under the
weights the reply names. Skipped when smg is not installed (`pip install smg==1.13.0`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import pytest

from tests.server.test_custom_params import PROMPT, WIDTH, catalog_rows, ranking, served_items
from tests.support.serverproc import free_port, running_server, start_servers

rl_client = pytest.importorskip("smg.rl")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SELECTOR = "engine=sglang"  # smg detects a grctl server as an SGLang worker


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = check()
            if got:
                return got
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_checkpoint):
    """Two grctl servers, then smg in front of them with the RL control plane mounted."""
    root = tmp_path_factory.mktemp("smg")
    catalog = root / "catalog.jsonl"
    catalog.write_text("\n".join(json.dumps(r) for r in catalog_rows()) + "\n")
    with ExitStack() as stack:
        flags = ("--model-path", str(tiny_checkpoint), "--catalog", str(catalog))
        servers = start_servers(
            stack, 2, *flags, "--allow-weight-update", "--max-running-requests", "7"
        )
        port = free_port()
        cmd = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-urls", *(s.url for s in servers), "--policy", "round_robin"]
        cmd += ["--enable-rl", "--log-level", "warn"]
        with open(root / "smg.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

        def stop_smg() -> None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        stack.callback(stop_smg)
        url = f"http://127.0.0.1:{port}"
        rl = rl_client.RL(url, timeout=60)
        wait_for(
            lambda: (
                sorted(w.url for w in rl.workers() if w.health == "ready")
                == sorted(s.url for s in servers)
            ),
            120,  # smg retries a failed first probe 30 s later: a loaded machine may need it
            f"both workers ready behind smg ({root / 'smg.log'})",
        )
        yield url, rl, servers


def generate(url: str, sampling_params: dict) -> httpx.Response:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, **sampling_params}}
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_rl_workers_are_the_fleet_as_registered(fleet):
    url, rl, servers = fleet
    workers = rl.workers()
    assert sorted(w.control_url for w in workers) == sorted(s.url for s in servers)
    for w in workers:
        assert w.engine == "sglang" and w.weight_version == "default"
        assert w.tp_size == w.dp_size == w.pp_size == 1
        assert set(w.capabilities["pause_modes"]) == {"abort", "retract", "in_place"}

    # smg read /v1/loads (SGLang's shape): its own /get_loads carries this fleet's figures
    def polled() -> list[dict]:
        rows = [x for x in httpx.get(url + "/get_loads").json()["loads"] if "memory" in x]
        return rows if len(rows) == 2 else []

    loads = wait_for(polled, 30, "smg to poll both workers' loads")
    assert {x["max_running_requests"] for x in loads} == {7}
    assert all(x["queues"]["paused"] == 0 for x in loads)


def test_excluded_items_through_smg(fleet, tiny_checkpoint):
    url, _, _ = fleet
    best = ranking(tiny_checkpoint)
    excluded = best[:2]
    want = ranking(tiny_checkpoint, excluded)
    for _ in range(2):  # round robin: each worker once
        plain = generate(url, {"n": WIDTH})
        assert plain.status_code == 200, plain.text
        assert served_items(plain.json()) == best
        # GR controls inside custom_params, the one place smg keeps engine-specific fields
        custom = generate(url, {"n": WIDTH, "custom_params": {"exclude_item_ids": excluded}})
        assert custom.status_code == 200, custom.text
        assert served_items(custom.json()) == want
        assert not set(excluded) & set(served_items(custom.json()))
    # beside the other sampling_params, smg 1.13 drops the field: the items come back
    dropped = generate(url, {"n": WIDTH, "exclude_item_ids": excluded})
    assert served_items(dropped.json()) == best


def test_push_pause_resume_through_smg(fleet, tiny_checkpoint, checkpoint):
    """The trainer's window through smg alone: pause every worker (a request meanwhile is the
    pause's 503), flush, update from disk, continue; then every worker serves the new weights."""
    url, rl, servers = fleet
    new = checkpoint(seed=1)
    want = ranking(new, excluded=[0, 1])
    assert want != ranking(tiny_checkpoint, excluded=[0, 1])  # the push changes the answer
    with rl_client.paused(rl, SELECTOR) as pause:
        assert pause.succeeded == pause.total == 2
        refused = generate(url, {"n": WIDTH})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "paused"
        flushed = rl.fanout("flush_cache", None, selector=SELECTOR, method="GET")
        assert {r.status for r in flushed.results.values()} == {200}
        body = {"model_path": str(new), "weight_version": "1"}
        updated = rl.fanout("update_weights_from_disk", body, selector=SELECTOR)
        assert {r.body["weight_version"] for r in updated.results.values()} == {"1"}
    versions = rl.fanout("get_weight_version", None, selector=SELECTOR, method="GET")
    assert {r.body["weight_version"] for r in versions.results.values()} == {"1"}
    for _ in range(2):
        reply = generate(url, {"n": WIDTH, "custom_params": {"exclude_item_ids": [0, 1]}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["meta_info"]["weight_version"] == "1"
        assert served_items(reply.json()) == want
    # /v1/rl/workers reports the version each worker had when it registered, not the live one
    assert {w.weight_version for w in rl.workers()} == {"default"}
    for srv in servers:
        assert httpx.get(srv.url + "/get_weight_version").json()["weight_version"] == "1"


def test_a_replica_joins_smg_once_it_listens(fleet, tiny_checkpoint):
    """--router-url against smg: the join waits until the replica answers, so smg's first
    probe passes (a failed one is retried 30 s later) and the replica is ready at once; it
    leaves at shutdown."""
    url, rl, servers = fleet
    with running_server("--model-path", str(tiny_checkpoint), "--router-url", url) as extra:
        t0 = time.monotonic()
        wait_for(
            lambda: extra.url in {w.url for w in rl.workers() if w.health == "ready"},
            20,
            "the joined replica ready behind smg",
        )
        assert time.monotonic() - t0 < 20
        assert "joined the router" in extra.log_text()
    wait_for(lambda: extra.url not in {w.url for w in rl.workers()}, 20, "the replica gone")
    assert sorted(w.url for w in rl.workers()) == sorted(s.url for s in servers)
