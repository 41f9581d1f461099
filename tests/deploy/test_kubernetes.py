"""deploy/kubernetes/grctl.yaml: valid against the Kubernetes schemas, and what its replica
container runs, run here: the same command, flags and environment (the pod's IP, GPU, volumes
and secret replaced by this machine's loopback, CPU, a tiny checkpoint and a test key), its
probes answered, its preStop leaving the gateway and draining the running request."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import pytest

from grctl.client.router import list_workers
from tests.support.serverproc import REPO_ROOT, running_server

yaml = pytest.importorskip("yaml")
MANIFEST = REPO_ROOT / "deploy" / "kubernetes" / "grctl.yaml"
KEY = "k8s-test-key"
pytestmark = pytest.mark.timeout(300)


def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def replica_container() -> dict:
    (deploy,) = [
        d for d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "grctl"
    ]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return container


def test_the_manifest_is_valid_against_the_kubernetes_schemas():
    validate = pytest.importorskip("kubernetes_validate")
    for doc in documents():
        validate.validate(doc, "1.33", strict=True)  # raises on any schema violation
    kinds = sorted(d["kind"] for d in documents())
    assert kinds == ["Deployment", "Deployment", "PodDisruptionBudget", "Service"]


def test_the_probes_and_prestop_work_as_the_manifest_runs_them(tmp_path, tiny_checkpoint):
    pytest.importorskip("sglang_router")
    from tests.client.test_router import running_router, wait_for

    c = replica_container()
    assert c["command"] == ["grctl", "serve"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    stand_in = {  # what only a cluster has, and this machine's stand-in for it
        "--model-path": str(tiny_checkpoint),
        "--device": "cpu",
        "--weights-root": str(tmp_path),
    }
    with running_router(tmp_path / "router.log") as router:
        args = []
        for arg in c["args"]:
            flag, _, value = arg.partition("=")
            if flag in ("--host", "--port"):  # the pod's IP and port: running_server's own
                continue
            value = {"--router-url": router}.get(flag, stand_in.get(flag, value))
            args.append(f"{flag}={value}" if value else flag)
        env = {}
        for var in c["env"]:
            if "secretKeyRef" in var.get("valueFrom", {}):
                env[var["name"]] = KEY
            elif "value" in var:
                env[var["name"]] = var["value"]
        with running_server(*args, env=env) as srv:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                path = c[probe]["httpGet"]["path"]  # kubelet sends no key
                assert httpx.get(srv.url + path, timeout=10).status_code == 200, probe
            assert httpx.post(srv.url + "/generate", json={"input_ids": [1]}).status_code == 401
            wait_for(lambda: srv.url in {w["url"] for w in list_workers(router)}, 60, "join")
            headers = {"Authorization": f"Bearer {KEY}"}
            reply: dict = {}

            def long_request() -> None:
                # 64 beams of 60 tokens after a 400-token prompt: still running when the hook
                # starts (the poll below checks it, every 10 ms)
                prompt = [1 + i % 100 for i in range(400)]
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 60, "n": 64}}
                r = httpx.post(srv.url + "/generate", json=body, headers=headers, timeout=120)
                reply.update(r.json())

            worker = threading.Thread(target=long_request)
            worker.start()
            deadline, in_flight = time.monotonic() + 30, 0
            while not in_flight and not reply and time.monotonic() < deadline:
                load = httpx.get(srv.url + "/v1/loads", headers=headers).json()["loads"][0]
                in_flight = load["num_running_reqs"] + load["num_waiting_reqs"]
                time.sleep(0.01)
            assert in_flight and not reply, f"the request ended before the hook: {reply}"
            # the preStop hook, with this server's pid for the container's PID 1
            hook = c["lifecycle"]["preStop"]["exec"]["command"]
            pid = str(srv.proc.pid)
            script = hook[-1].replace("kill -TERM 1;", f"kill -TERM {pid};")
            script = script.replace("kill -0 1 ", f"kill -0 {pid} ")
            assert script.count(pid) == 2, script
            prestop = subprocess.Popen([*hook[:-1], script])
            srv.proc.wait(120)  # reaped here (in a pod it is PID 1: its exit ends the container)
            assert prestop.wait(10) == 0  # the hook returns once the server has exited
            assert srv.proc.returncode in (0, -15)  # uvicorn re-raises the SIGTERM it drained on
            worker.join(60)
            assert reply["meta_info"]["finish_reason"]["type"] == "length"  # drained, not cut
            assert len(reply["output_ids"]) == 60
            assert srv.url not in {w["url"] for w in list_workers(router)}
            assert "left the router" in srv.log_text()
