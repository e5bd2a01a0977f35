"""The rendered cpu-aggregated manifests describe a working fleet: every container of the
overlay runs on this machine as a process, with the command, args and environment the rendered
YAML gives it, and a request through each public port returns the greedy answer.

Kubernetes is mimicked where it must be, and nowhere else:
- each pod gets its own loopback address (127.a.b.c; the whole 127/8 is loopback on Linux), as
  each pod has its own IP, so the manifests' fixed ports are used as they are;
- a wildcard bind (`--host=0.0.0.0`) binds the pod's address;
- a Service name resolves to the address of the one pod it selects, its port to the container
  port it targets;
- the downward API (`status.podIP`, `metadata.name`), ConfigMap `envFrom`, optional Secret
  references that are absent, and `$(VAR)` expansion in args follow the kubelet's rules;
- readiness is each container's own readinessProbe (gRPC health with its service name, or
  HTTP GET), polled until it passes.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kube_render import container_port, of_kind, pod_templates, render, selects

from llmfleet.client.generation import GenerationClient
from llmfleet.client.llm import LLM
from llmfleet.shared.core.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(420)

OVERLAY = "cpu-aggregated"
PROMPT = "The capital of France is"
MAX_TOKENS = 12
STARTUP_S = 300.0


@dataclass
class Pod:
    name: str  # the workload's name, as a pod of it would be called
    ip: str
    labels: dict[str, str]
    containers: list[dict[str, Any]]
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)


def _pods(docs: list[dict[str, Any]]) -> list[Pod]:
    """One pod per workload (the overlay runs one replica of each), each with its address."""
    base = f"127.{random.randrange(10, 250)}.{random.randrange(0, 250)}"
    pods = []
    for i, tpl in enumerate(pod_templates(docs)):
        name = tpl.owner.split("/")[1]
        assert not tpl.spec.get("initContainers"), f"{name}: init containers are not run here"
        pods.append(Pod(f"{name}-0", f"{base}.{i + 1}", tpl.labels, tpl.containers))
    return pods


def _service_addresses(docs: list[dict[str, Any]], pods: list[Pod]) -> dict[str, str]:
    """'service:port' -> 'pod ip:container port', for every Service port of the overlay."""
    out: dict[str, str] = {}
    for name, svc in of_kind(docs, "Service").items():
        chosen = [p for p in pods if selects(svc["spec"]["selector"], p.labels)]
        assert len(chosen) == 1, f"Service {name} selects {len(chosen)} pods"
        pod = chosen[0]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            resolved = [container_port(c, target) for c in pod.containers]
            number = next((n for n in resolved if n is not None), None)
            assert number is not None, f"Service {name} targets {target}, which {pod.name} lacks"
            out[f"{name}:{port['port']}"] = f"{pod.ip}:{number}"
    return out


def _env(container: dict[str, Any], pod: Pod, docs: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (envFrom first, then env)."""
    configmaps = of_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"{pod.name}: envFrom {source} is not run here"
        env.update(configmaps[source["configMapRef"]["name"]].get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            env[var["name"]] = {"status.podIP": pod.ip, "metadata.name": pod.name}[path]
        elif "secretKeyRef" in ref:  # no Secret exists here: it must be optional
            assert ref["secretKeyRef"].get("optional"), f"{pod.name}: {var['name']} needs a Secret"
        elif "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            env[var["name"]] = configmaps[key["name"]]["data"][key["key"]]
        else:
            raise AssertionError(f"{pod.name}: {var['name']} comes from {ref}, not run here")
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: a defined variable is replaced, `$$` escapes."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: _one(m, env), text)


def _one(m: re.Match[str], env: dict[str, str]) -> str:
    if m.group(0) == "$$":
        return "$"
    name = m.group(1)
    assert name in env, f"$({name}) names no variable of the container"
    return env[name]


def _argv(container: dict[str, Any], pod: Pod, env: dict[str, str], services: dict[str, str]):
    """command + args, expanded, with Service names and wildcard binds made loopback."""
    words = [_expand(w, env) for w in [*container["command"], *container.get("args", [])]]
    out = []
    for w in words:
        w = re.sub(r"(?<==)0\.0\.0\.0$", pod.ip, w)
        for svc, addr in services.items():
            w = re.sub(rf"(?<![\w.-]){re.escape(svc)}(?![\w.-])", addr, w)
        out.append(w)
    assert out[0] == "llmfleet", f"{pod.name}: runs {out[0]}, not an llmfleet entry point"
    return [str(Path(sys.executable).with_name("llmfleet")), *out[1:]]


def _ready(container: dict[str, Any], pod: Pod) -> bool:
    probe = container["readinessProbe"]
    try:
        if "grpc" in probe:
            g = probe["grpc"]
            with grpc.insecure_channel(f"{pod.ip}:{g['port']}") as ch:
                req = health_pb2.HealthCheckRequest(service=g.get("service", ""))
                status = health_pb2_grpc.HealthStub(ch).Check(req, timeout=3).status
            return status == health_pb2.HealthCheckResponse.SERVING
        get = probe["httpGet"]
        url = f"http://{pod.ip}:{container_port(container, get['port'])}{get['path']}"
        with urllib.request.urlopen(url, timeout=3) as resp:
            return 200 <= resp.status < 400
    except (grpc.RpcError, OSError):
        return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    docs = render(OVERLAY)
    pods = _pods(docs)
    services = _service_addresses(docs, pods)
    logs = tmp_path_factory.mktemp("manifest-pods")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("LLMFLEET_")}
    try:
        for pod in pods:  # all at once, in no order, as a cluster starts them
            for c in pod.containers:
                env = _env(c, pod, docs)
                argv = _argv(c, pod, env, services)
                log = logs / f"{pod.name}-{c['name']}.log"
                with open(log, "w") as out:
                    proc = subprocess.Popen(
                        argv, env={**base_env, **env}, stdout=out, stderr=subprocess.STDOUT
                    )
                pod.procs.append(proc)
                pod.logs.append(log)
        deadline = time.monotonic() + STARTUP_S
        for pod in pods:
            for c, proc, log in zip(pod.containers, pod.procs, pod.logs, strict=True):
                while not _ready(c, pod):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        tail = log.read_text()[-3000:]
                        pytest.fail(f"{pod.name}/{c['name']} never became ready:\n{tail}")
                    time.sleep(0.2)
        yield {"pods": pods, "services": services}
    finally:
        for pod in pods:
            for proc in pod.procs:
                proc.terminate()
        for pod in pods:
            for proc in pod.procs:
                try:
                    proc.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture(scope="module")
def greedy() -> tuple[list[int], str]:
    """The bundled model's greedy completion of PROMPT, from the in-process engine."""
    llm = LLM()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    result = llm.generate([PROMPT], params)[0]
    return result.completions[0].token_ids, result.completions[0].text


def test_a_request_through_the_gateway_returns_the_greedy_answer(fleet, greedy):
    gateway = fleet["services"]["llmfleet-gateway:8000"]
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with urllib.request.urlopen(f"http://{gateway}/v1/models", timeout=10) as resp:
        body["model"] = json.loads(resp.read())["data"][0]["id"]
    req = urllib.request.Request(
        f"http://{gateway}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    assert answer["choices"][0]["text"] == greedy[1]
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_request_through_the_router_returns_the_greedy_tokens(fleet, greedy):
    router = fleet["services"]["llmfleet-router:50051"]
    with GenerationClient(router) as client:
        result = client.generate(
            PROMPT, raw=True, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
        workers = client.server_info().workers
    assert result.completions[0].token_ids == greedy[0]
    # the worker registered at its pod's address, which the router reached it at
    worker_pod = next(p for p in fleet["pods"] if p.name.startswith("llmfleet-worker"))
    assert [w.address for w in workers] == [f"{worker_pod.ip}:50060"]


def test_every_container_is_ready_by_its_own_probe_and_still_running(fleet):
    for pod in fleet["pods"]:
        for c, proc in zip(pod.containers, pod.procs, strict=True):
            assert proc.poll() is None, f"{pod.name}/{c['name']} exited"
            assert _ready(c, pod), f"{pod.name}/{c['name']} is not ready"
