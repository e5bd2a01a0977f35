"""deploy/kubernetes/ renders, and what it renders is valid (issue 26, acceptance criterion 1).

Every overlay, and every opt-in component on top of one (kube_render.VARIANTS), renders with
`kubectl kustomize`; every core resource passes `kubernetes-validate` (strict) against
Kubernetes 1.32; the custom resources have the apiVersion and kind their controllers serve, and
what they name exists: the InferencePool's pods and endpoint picker, the HTTPRoute's pool, the
scaled Deployments, the metrics the autoscalers read (exported by the services), the scraped
metrics ports.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kube_render import (
    KUBE,
    VARIANT_NAMES,
    VARIANTS,
    container_port,
    exported_metrics,
    jobs_in,
    label_selector,
    metric_names,
    of_kind,
    pod_templates,
    render,
    rendered_text,
    selects,
    service_reaches,
)

pytestmark = pytest.mark.timeout(120)

K8S_VERSION = "1.32.0"
CORE_GROUPS = {"v1", "apps/v1", "policy/v1", "autoscaling/v2", "networking.k8s.io/v1"}
CUSTOM = {
    "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
    "ScaledObject": "keda.sh/v1alpha1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
}


def test_every_overlay_and_component_is_rendered():
    overlays = {p.name for p in (KUBE / "overlays").iterdir() if p.is_dir()}
    components = {p.name for p in (KUBE / "components").iterdir() if p.is_dir()}
    assert overlays == {v.overlay for v in VARIANTS}
    used = set()
    for variant in VARIANTS:
        text = (KUBE / "overlays" / variant.overlay / "kustomization.yaml").read_text()
        used |= {c for c in components if f"components/{c}\n" in text} | set(variant.add)
    assert used == components, f"never rendered: {components - used}"


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_renders_to_named_resources(name):
    assert rendered_text(name).strip(), f"{name} rendered nothing"
    docs = render(name)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "a resource is rendered twice"
    for doc in docs:
        assert doc.get("apiVersion") and doc["metadata"].get("name"), doc


def test_validator_knows_a_current_kubernetes():
    versions = kubernetes_validate.utils.all_versions()
    assert K8S_VERSION in versions, f"kubernetes-validate ships only {sorted(set(versions))}"


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_core_resources_validate(name):
    docs = render(name)
    for doc in docs:
        if doc["apiVersion"] in CORE_GROUPS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        else:
            assert CUSTOM.get(doc["kind"]) == doc["apiVersion"], (doc["kind"], doc["apiVersion"])
    for tpl in pod_templates(docs):  # a LeaderWorkerSet's templates are pods too
        if tpl.owner.startswith("LeaderWorkerSet/"):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": tpl.labels}}
            kubernetes_validate.validate({**pod, "spec": tpl.spec}, K8S_VERSION, strict=True)


def _pods(docs: list[dict[str, Any]], match: dict[str, str]):
    return [t for t in pod_templates(docs) if selects(match, t.labels)]


@pytest.mark.parametrize("name", [n for n in VARIANT_NAMES if "gateway-api" in n])
def test_inference_pool_names_worker_pods_and_the_picker(name):
    docs = render(name)
    (pool,) = of_kind(docs, "InferencePool").values()
    spec = pool["spec"]
    (target,) = spec["targetPorts"]
    pods = _pods(docs, label_selector(spec["selector"]))
    assert pods and all(t.labels["app.kubernetes.io/component"] == "worker" for t in pods)
    for tpl in pods:  # each pod's gateway container serves the target port
        assert any(container_port(c, target["number"]) for c in tpl.containers), tpl.owner
    ref = spec["endpointPickerRef"]
    assert ref.get("group", "") == "" and ref["kind"] == "Service"
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    service = of_kind(docs, "Service")[ref["name"]]
    assert service_reaches(docs, service, ref["port"]["number"])
    router = next(t for t in pods_of(docs, "router"))
    assert f"--epp-port={ref['port']['number']}" in router.containers[0]["args"]
    assert f"--epp-target-port={target['number']}" in router.containers[0]["args"]
    (route,) = of_kind(docs, "HTTPRoute").values()
    refs = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert refs == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llmfleet"}
    ]
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


def pods_of(docs, component: str):
    return [t for t in pod_templates(docs) if t.labels["app.kubernetes.io/component"] == component]


def _check_queries(job_default: str, queries: list[str]) -> None:
    for query in queries:
        jobs = jobs_in(query) or {job_default}
        names = metric_names(query)
        assert names, query
        for job in jobs:
            missing = names - exported_metrics(job)
            assert not missing, f"{job} exports no {missing} ({query})"


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_autoscalers_scale_real_workers_on_exported_metrics(name):
    docs = render(name)
    deployments = of_kind(docs, "Deployment")
    scalers = list(of_kind(docs, "ScaledObject").values())
    hpas = list(of_kind(docs, "HorizontalPodAutoscaler").values())
    if name.startswith("gpu-") and "multinode" not in name:
        assert len(scalers) + len(hpas) == sum(
            d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
            for d in deployments.values()
        ), "every worker Deployment scales"
    for so in scalers:
        ref = so["spec"]["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment" and ref["name"] in deployments
        assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
        triggers = so["spec"]["triggers"]
        assert triggers and all(t["type"] == "prometheus" for t in triggers)
        for t in triggers:
            assert t["metadata"]["serverAddress"].startswith("http")
            assert float(t["metadata"]["threshold"]) > 0
        _check_queries("llmfleet-worker", [t["metadata"]["query"] for t in triggers])
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":
                _check_queries("llmfleet-worker", [metric["pods"]["metric"]["name"]])
            else:
                m = metric["external"]["metric"]
                job = m["selector"]["matchLabels"]["job"]
                _check_queries(job, [m["name"]])


@pytest.mark.parametrize("name", [n for n in VARIANT_NAMES if n.startswith("gpu-")])
def test_every_metrics_port_is_scraped(name):
    docs = render(name)
    (monitor,) = of_kind(docs, "ServiceMonitor").values()
    match = label_selector(monitor["spec"]["selector"])
    endpoints = {e["port"] for e in monitor["spec"]["endpoints"]}
    scraped: set[tuple[str, int]] = set()
    for svc in of_kind(docs, "Service").values():
        if not selects(match, svc["metadata"].get("labels", {})):
            continue
        for sp in svc["spec"]["ports"]:
            if sp["name"] in endpoints:
                for tpl in _pods(docs, svc["spec"]["selector"]):
                    scraped.add((tpl.owner, container_port(tpl.containers[0], sp["targetPort"])))
    for tpl in pod_templates(docs):
        for c in tpl.containers:
            for p in c.get("ports", []):
                if p["name"] == "metrics":
                    assert (tpl.owner, p["containerPort"]) in scraped, (tpl.owner, p)
    assert "llmfleet.io/role" in monitor["spec"]["podTargetLabels"]


def test_leaderworkerset_groups_workers():
    docs = render("gpu-multinode")
    (lws,) = of_kind(docs, "LeaderWorkerSet").values()
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] >= 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert not [t for t in pods_of(docs, "worker") if t.owner.startswith("Deployment/")]
    for part in ("leaderTemplate", "workerTemplate"):
        spec = lwt[part]["spec"]
        (worker,) = [c for c in spec["containers"] if c["name"] == "worker"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        config = worker["envFrom"][0]["configMapRef"]["name"]
        assert config in of_kind(docs, "ConfigMap"), "the settings' hashed name reaches it"
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims and all(c in of_kind(docs, "PersistentVolumeClaim") for c in claims)


def test_leaderworkerset_runs_one_tensor_parallel_worker_per_group():
    """The leader serves and runs rank 0 of $(LWS_GROUP_SIZE) ranks, listening for the others
    at its tp port; each worker pod joins it there as rank $(LWS_WORKER_INDEX)."""
    docs = render("gpu-multinode")
    (lws,) = of_kind(docs, "LeaderWorkerSet").values()
    lwt = lws["spec"]["leaderWorkerTemplate"]
    args = {}
    for part in ("leaderTemplate", "workerTemplate"):
        (worker,) = [c for c in lwt[part]["spec"]["containers"] if c["name"] == "worker"]
        args[part] = dict(a.split("=", 1) for a in worker["args"])
    leader, follower = args["leaderTemplate"], args["workerTemplate"]
    assert leader["--tensor-parallel-size"] == follower["--tensor-parallel-size"]
    assert leader["--tensor-parallel-size"] == "$(LWS_GROUP_SIZE)"
    assert leader["--tp-local-ranks"] == "1" and "--router" in leader
    (port,) = [
        p["containerPort"]
        for c in lwt["leaderTemplate"]["spec"]["containers"]
        for p in c["ports"]
        if p["name"] == "tp"
    ]
    assert leader["--tp-port"] == str(port)
    assert follower == {
        "--tp-join": f"$(LWS_LEADER_ADDRESS):{port}",
        "--tp-rank": "$(LWS_WORKER_INDEX)",
        "--tensor-parallel-size": "$(LWS_GROUP_SIZE)",
    }
