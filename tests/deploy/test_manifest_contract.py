"""The rendered manifests start the services they describe (issue 26, acceptance criterion 3).

For every llmfleet container of every rendered variant: its command is `llmfleet <service>`,
whose own parser takes its args (every `$(VAR)` one the container defines) and whose configs
accept them over the container's environment (settings ConfigMap, env); the ports it declares
are exactly the ones those configs open; every probe checks a port the service opens, with a
health service name it registers there (the names come from the services' code); every
Service name in its args is a Service reaching that port. The NetworkPolicies leave only the
public ports open to the world (router 50051, gateway 8000; with the inference gateway, the
endpoint picker 9002 and the workers' gateways 8000).
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from kube_render import (
    VARIANT_NAMES,
    PodTemplate,
    container_port,
    of_kind,
    pod_templates,
    render,
    selects,
    service_reaches,
)

from llmfleet.cli.services import service_parser
from llmfleet.services.gateway.app import ROUTES
from llmfleet.services.kvstore.server import SERVICE_NAME as KVSTORE
from llmfleet.services.router.server import GENERATION, REGISTRY
from llmfleet.services.tokenizer.server import SERVICE_NAME as TOKENIZER
from llmfleet.services.worker.server import SERVICE_NAME as WORKER
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire import health_probe, tracing

pytestmark = pytest.mark.timeout(120)

PROBE = ["python", "-m", "llmfleet.shared.wire.health_probe"]
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
PLACEHOLDERS = {"status.podIP": "10.1.2.3", "metadata.name": "llmfleet-worker-abc12"}
# What the LWS controller adds to the environment of a LeaderWorkerSet's pods (its worker pods:
# index 1 and up).
LWS_ENV = {"LWS_LEADER_ADDRESS": "lws-leader-0.lws", "LWS_GROUP_SIZE": "2"}


@dataclass
class Opened:
    """What a service's configs make it open: gRPC ports with the health names registered on
    each and whether each takes only mutual TLS, an HTTP port, other ports."""

    grpc: dict[int, tuple[set[str], bool]] = field(default_factory=dict)
    http: int | None = None
    other: set[int] = field(default_factory=set)
    tls_dir: str | None = None
    grace_s: float = 30.0  # the drain grace (Service's default for tokenizer, kvstore)

    @property
    def ports(self) -> set[int]:
        return {*self.grpc, *self.other, *([self.http] if self.http else [])}


def opened(service: str, parsed: tuple[Any, ...]) -> Opened:
    cfg = parsed[0]
    tls = cfg.tls_dir is not None if hasattr(cfg, "tls_dir") else False
    out = Opened(other={cfg.metrics_port} - {None, 0}, tls_dir=getattr(cfg, "tls_dir", None))
    if service == "gateway":
        out.http, out.grace_s = cfg.port, cfg.grace_s
    elif service == "router":
        public = {"", GENERATION} | (set() if cfg.internal_port else {REGISTRY})
        out.grpc[cfg.port] = (public, False)  # the public port is plaintext
        if cfg.internal_port:
            out.grpc[cfg.internal_port] = ({"", REGISTRY}, tls)
        out.other |= {cfg.epp_port} - {None}
        out.grace_s = cfg.grace_s
    else:
        if service == "worker" and parsed[1].tp_join is not None:
            return Opened()  # a rank joining another pod's worker: it serves nothing
        names = {"tokenizer": TOKENIZER, "kvstore": KVSTORE, "worker": WORKER}[service]
        out.grpc[cfg.port] = ({"", names}, tls)
        if service == "kvstore":
            out.other |= {cfg.data_port, cfg.events_port}
        if service == "worker":
            out.grace_s = parsed[2]
            engine = parsed[1]
            if (engine.tp_local_ranks or engine.tensor_parallel_size) < engine.tensor_parallel_size:
                out.other.add(engine.tp_port)  # the other ranks join its group there
    return out


def container_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The environment the container starts with (optional Secrets absent)."""
    env: dict[str, str] = {}
    maps = of_kind(docs, "ConfigMap")
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = PLACEHOLDERS[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["optional"] is True, f"{var['name']}: a required Secret"
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        assert m[1] in env, f"{arg}: $({m[1]}) is not defined in the container"
        return env[m[1]]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)


def start(
    docs, container, monkeypatch, capsys, lws_index: int | None = None
) -> tuple[str, Opened, dict[str, str]]:
    """Parse the container's command line as the service would (a LeaderWorkerSet's pod of
    index `lws_index`: with the variables LWS adds); what it opens."""
    command = container["command"]
    assert len(command) == 2, f"command {command}: flags go in args"
    service = command[1]
    env = container_env(docs, container)
    if lws_index is not None:
        env |= {**LWS_ENV, "LWS_WORKER_INDEX": str(lws_index)}
    args = [expand(a, env) for a in container.get("args", [])]
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith(("LLMFLEET_", "OTEL_"))]:
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        try:
            service_parser(service).parse_args(args)  # `llmfleet <service>`: the image's command
            main = importlib.import_module(f"llmfleet.services.{service}.__main__")
            parsed = main.SERVICE.parse(args)  # ... and its configs, over the environment
            tracing.exporter_names()  # OTEL_* values it can use
            tracing.otlp_protocol()
        except SystemExit:
            pytest.fail(
                f"llmfleet {service} {' '.join(args)}:\n{capsys.readouterr().err}", pytrace=False
            )
        except ValidationError as exc:
            pytest.fail(f"llmfleet {service}: {exc}")
    return service, opened(service, parsed), env


def check_probe(kind: str, probe: dict[str, Any], opens: Opened, where: str) -> None:
    if "grpc" in probe:
        port, name = probe["grpc"]["port"], probe["grpc"].get("service", "")
        assert port in opens.grpc, f"{where} {kind}: port {port} is not a gRPC port it opens"
        names, tls = opens.grpc[port]
        assert name in names, f"{where} {kind}: {name!r} is not registered on {port} ({names})"
        assert not tls, f"{where} {kind}: the kubelet's gRPC probe cannot pass mutual TLS"
    elif "exec" in probe:
        command = probe["exec"]["command"]
        assert command[:3] == PROBE, f"{where} {kind}: {command}"
        args = health_probe.build_parser().parse_args(command[3:])
        host, _, port = args.address.rpartition(":")
        assert host == "127.0.0.1" and int(port) in opens.grpc, f"{where} {kind}: {args.address}"
        names, tls = opens.grpc[int(port)]
        assert args.service in names, f"{where} {kind}: {args.service!r} not in {names}"
        assert args.tls_dir == (opens.tls_dir if tls else None), f"{where} {kind}: tls"
    elif "tcpSocket" in probe:
        assert probe["tcpSocket"]["port"] in opens.ports, f"{where} {kind}"
    else:
        assert probe["httpGet"]["port"] == opens.http, f"{where} {kind}: not its HTTP port"
        assert probe["httpGet"]["path"] in ROUTES, f"{where} {kind}: {probe['httpGet']['path']}"
        if kind == "readinessProbe":
            assert probe["httpGet"]["path"] == "/health"


def check_names_resolve(docs, tpl: PodTemplate, values: list[str]) -> None:
    services = of_kind(docs, "Service")
    for value in values:
        for name, port in re.findall(r"\b(llmfleet-[a-z-]+):(\d+)\b", value):
            assert name in services, f"{tpl.owner}: {value} names no Service"
            assert service_reaches(docs, services[name], int(port)), f"{tpl.owner}: {value}"


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_containers_start_with_probes_on_ports_they_open(name, monkeypatch, capsys):
    docs = render(name)
    seen = set()
    for tpl in pod_templates(docs):
        spec = tpl.spec
        assert spec["enableServiceLinks"] is False, f"{tpl.owner}: service links set LLMFLEET_*"
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        for c in tpl.containers:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
            if c.get("command", [None])[0] != "llmfleet":
                continue
            lws_index = None
            if tpl.owner.startswith("LeaderWorkerSet/"):
                lws_index = 0 if tpl.owner.endswith("/leaderTemplate") else 1
            service, opens, env = start(docs, c, monkeypatch, capsys, lws_index)
            seen.add(service)
            where = f"{name} {tpl.owner}/{c['name']}"
            assert tpl.labels["app.kubernetes.io/component"] in (service, "worker")
            if service == "worker" and not opens.ports:  # a rank joining the leader's group
                assert lws_index, f"{where}: only a LeaderWorkerSet's worker pods join a group"
                assert "ports" not in c and not set(PROBES) & set(c), where
                continue
            if service == "worker":
                role = dict(a.split("=", 1) for a in c["args"] if "=" in a)["--role"]
                assert tpl.labels["llmfleet.io/role"] == role
            declared = {p["containerPort"] for p in c["ports"]}
            assert declared == opens.ports, f"{where}: declares {declared}, opens {opens.ports}"
            for kind in PROBES:
                check_probe(kind, c[kind], opens, where)
            assert spec["terminationGracePeriodSeconds"] > opens.grace_s, where
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}
            check_names_resolve(docs, tpl, [*c["args"], *env.values()])
    assert seen == {"gateway", "router", "tokenizer", "kvstore", "worker"}


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_every_workload_has_labels_and_a_disruption_budget(name):
    docs = render(name)
    budgets = [
        b["spec"]["selector"]["matchLabels"] for b in of_kind(docs, "PodDisruptionBudget").values()
    ]
    for tpl in pod_templates(docs):
        for key in ("name", "component", "part-of"):
            assert tpl.labels.get(f"app.kubernetes.io/{key}"), (tpl.owner, key)
        if tpl.labels["app.kubernetes.io/component"] != "otel-collector":
            assert any(selects(b, tpl.labels) for b in budgets), f"{tpl.owner}: no PDB"


# ---- NetworkPolicy -----------------------------------------------------------------------------

NS = "kubernetes.io/metadata.name"
OUTSIDE = ({NS: "elsewhere"}, {}, False)  # (its namespace's labels, its labels, in the fleet's ns)
MONITORING = ({NS: "monitoring"}, {}, False)
FLEET = ({NS: "llmfleet"}, {"app.kubernetes.io/part-of": "llmfleet"}, True)


def _peer_matches(peer: dict[str, Any], source) -> bool:
    ns_labels, labels, same_ns = source
    if "ipBlock" in peer:
        return source is OUTSIDE
    pods = peer.get("podSelector")
    if "namespaceSelector" in peer:
        ns_ok = selects(peer["namespaceSelector"].get("matchLabels", {}), ns_labels)
        return ns_ok and (pods is None or selects(pods.get("matchLabels", {}), labels))
    return same_ns and selects(pods.get("matchLabels", {}), labels)


def _port_matches(rule_port: dict[str, Any], container: dict[str, Any], port: int) -> bool:
    first = rule_port["port"]
    if isinstance(first, str):  # a named port of the container
        return container_port(container, first) == port
    return first <= port <= rule_port.get("endPort", first)


def reachable(docs, tpl: PodTemplate, container: dict[str, Any], port: int, source) -> bool:
    policies = [
        p
        for p in of_kind(docs, "NetworkPolicy").values()
        if selects(p["spec"]["podSelector"].get("matchLabels", {}), tpl.labels)
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    assert policies, f"{tpl.owner}: no NetworkPolicy isolates it"
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(_port_matches(p, container, port) for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, source) for peer in peers):
                return True
    return False


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_network_policy_exposes_only_the_public_ports(name):
    docs = render(name)
    public = set()
    for tpl in pod_templates(docs):
        component = tpl.labels["app.kubernetes.io/component"]
        for c in tpl.containers:
            for p in c.get("ports", []):
                port = p["containerPort"]
                assert reachable(docs, tpl, c, port, FLEET), (tpl.owner, port)
                if p["name"] == "metrics":
                    assert reachable(docs, tpl, c, port, MONITORING), (tpl.owner, port)
                if reachable(docs, tpl, c, port, OUTSIDE):
                    public.add((component, port))
    expected = {("router", 50051), ("gateway", 8000)}
    if "gateway-api" in name:
        expected |= {("router", 9002), ("worker", 8000)}
    assert public == expected
