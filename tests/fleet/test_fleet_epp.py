"""The router's endpoint picker in front of real processes on loopback, as in Kubernetes with the
Gateway API Inference Extension: a router (prefix_aware, `--epp-port`) and a tokenizer, two
"pods" on their own addresses (127.0.0.2, 127.0.0.3: all of 127/8 is loopback on Linux), each a
worker with a gateway beside it on the same HTTP port. The test is the proxy: it asks the picker
over ext_proc v3 (an xds-protos client), then sends the request where the answer says."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from fleet_helpers import WORKER_ARGS, worker_stats
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.cli.fleet_plan import pick_free_ports
from llmfleet.client.generation import ClientError, GenerationClient

POD_HOSTS = ("127.0.0.2", "127.0.0.3")
STARTUP_TIMEOUT_S = 120.0
PROMPT = "A fleet of llamas grazes on the high plateau, where the wind is cold and dry. " * 2


class Processes:
    """Child services, each logging to its own file; a dead one fails the test with its log."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, service: str, *args: str) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", f"llmfleet.services.{service}", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{tail}")

    def wait_for(self, what: str, cond, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            self.check()
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def free_on_both(hosts: tuple[str, ...]) -> int:
    """A port free on every one of `hosts` (the pods' common HTTP port)."""
    for _ in range(50):
        [port] = pick_free_ports(1, hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on every pod address")


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def num_workers(router: str) -> int:
    try:
        with GenerationClient(router) as client:
            return len(client.server_info(timeout=2).workers)
    except ClientError:
        return 0


def serving(address: str) -> bool:
    """grpc.health SERVING (the router: its tokenizer is up and a worker is live)."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def model(make_checkpoint_module) -> str:
    return str(make_checkpoint_module("llama"))


@pytest.fixture(scope="module")
def pods(model, tmp_path_factory):
    """{"router", "epp", "http_port", "workers": [(grpc address, gateway URL) per pod]}."""
    procs = Processes(tmp_path_factory.mktemp("epp-logs"))
    tokenizer, router, registry, epp = pick_free_ports(4)
    http_port = free_on_both(POD_HOSTS)
    try:
        procs.start("tokenizer", "tokenizer", "--port", str(tokenizer), "--model", model)
        procs.start(
            "router", "router", "--port", str(router), "--internal-port", str(registry),
            "--tokenizer", f"127.0.0.1:{tokenizer}", "--routing-policy", "prefix_aware",
            "--epp-port", str(epp), "--epp-target-port", str(http_port),
        )  # fmt: skip
        workers = []
        for i, host in enumerate(POD_HOSTS):
            [port] = pick_free_ports(1, host)
            procs.start(
                f"worker-{i}", "worker", "--host", host, "--port", str(port),
                "--worker-id", f"worker-{i}", "--router", f"127.0.0.1:{registry}",
                "--model", model, *WORKER_ARGS,
            )  # fmt: skip
            procs.start(
                f"gateway-{i}", "gateway", "--host", host, "--port", str(http_port),
                "--router", f"127.0.0.1:{router}", "--model", model,
            )  # fmt: skip
            workers.append((f"{host}:{port}", f"http://{host}:{http_port}"))
        procs.wait_for("both workers", lambda: num_workers(f"127.0.0.1:{router}") == 2)
        procs.wait_for("the router and its picker", lambda: all(
            serving(f"127.0.0.1:{port}") for port in (router, epp)
        ))  # fmt: skip
        for _, url in workers:
            procs.wait_for(f"gateway {url}", lambda url=url: http_ok(url + "/health"))
        yield {
            "router": f"127.0.0.1:{router}",
            "epp": f"127.0.0.1:{epp}",
            "http_port": http_port,
            "workers": workers,
        }
    finally:
        procs.stop()


def pick(epp: str, path: str, body: bytes) -> ext_proc.ProcessingResponse:
    """What a proxy in BUFFERED mode asks for one POST: the answer to its body."""
    headers = [
        base_pb2.HeaderValue(key=k, raw_value=v.encode())
        for k, v in ((":method", "POST"), (":path", path), ("content-type", "application/json"))
    ]
    messages = [
        ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers))
        ),
        ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body, end_of_stream=True)),
    ]
    with grpc.insecure_channel(epp) as channel:
        answers = list(ext_proc_grpc.ExternalProcessorStub(channel).Process(iter(messages)))
    assert answers[0].WhichOneof("response") == "request_headers"  # continue: send the body
    return answers[-1]


def test_picker_names_the_pod_holding_the_prefix_and_that_pod_serves_it_cached(pods):
    (addr0, url0), (addr1, url1) = pods["workers"]
    with urllib.request.urlopen(url1 + "/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    # Idle, with no prefix anywhere, the policy would take worker-0 (ties go by id): pin the
    # first request to worker-1 through its gateway, as the picker's header would.
    status, first = post(url1 + "/v1/completions", body, {"x-llmfleet-worker": addr1})
    assert status == 200, first
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert worker_stats(addr0).prefix_cache_queries == 0  # the pin took it to worker-1

    raw = json.dumps(body).encode()
    answer = pick(pods["epp"], "/v1/completions", raw)
    mutation = answer.request_body.response.header_mutation
    headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    endpoint = f"{POD_HOSTS[1]}:{pods['http_port']}"
    assert headers == {"x-gateway-destination-endpoint": endpoint, "x-llmfleet-worker": addr1}
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == endpoint

    # The proxy sends the request, with the picker's headers, to the endpoint named.
    status, second = post(f"http://{endpoint}/v1/completions", body, headers)
    assert status == 200, second
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # greedy, same answer
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert worker_stats(addr1).prefix_cache_hits > 0
    assert worker_stats(addr0).prefix_cache_queries == 0  # worker-0 served nothing


def test_picker_refuses_a_malformed_body_with_400(pods):
    answer = pick(pods["epp"], "/v1/chat/completions", b'{"model": "m", "messages": "hi"}')
    immediate = answer.immediate_response
    assert immediate.status.code == 400
    error = json.loads(immediate.body)["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
