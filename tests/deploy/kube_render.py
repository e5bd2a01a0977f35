"""Rendering deploy/kubernetes/ with `kubectl kustomize`, and reading what was rendered.

Every overlay renders as it is, and in the variants that add the opt-in components (so each
component is rendered at least once): a variant is a copy of deploy/ in a temporary directory
whose overlay lists other components. Renders are cached for the session. Without kubectl a
render fails, saying so: the manifests are never left unchecked.
"""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"


@dataclass(frozen=True)
class Variant:
    overlay: str
    add: tuple[str, ...] = ()  # components appended to the overlay's list
    drop: tuple[str, ...] = ()  # components taken off it

    @property
    def name(self) -> str:
        parts = [self.overlay, *(f"+{c}" for c in self.add), *(f"-{c}" for c in self.drop)]
        return "".join(parts)


VARIANTS = (
    Variant("cpu-aggregated"),
    Variant("cpu-aggregated", add=("mtls",)),
    Variant("gpu-aggregated"),
    Variant("gpu-aggregated", add=("gateway-api", "mtls")),
    Variant("gpu-aggregated", add=("hpa",), drop=("keda",)),
    Variant("gpu-disaggregated"),
    Variant("gpu-disaggregated", add=("gateway-api", "mtls")),
    Variant("gpu-disaggregated", add=("hpa-disaggregated",), drop=("keda-disaggregated",)),
    Variant("gpu-multinode"),
)
VARIANT_NAMES = [v.name for v in VARIANTS]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not installed: the Kubernetes manifests (deploy/kubernetes/) cannot be "
            "rendered or checked. Install kubectl (it includes kustomize) and run again.",
            pytrace=False,
        )
    return path


@functools.cache
def _copy_of_deploy() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="llmfleet-kustomize-"))
    atexit.register(shutil.rmtree, tmp, True)
    shutil.copytree(DEPLOY, tmp / "deploy")
    return tmp / "deploy" / "kubernetes"


def _variant_dir(variant: Variant) -> Path:
    if not variant.add and not variant.drop:
        return KUBE / "overlays" / variant.overlay
    copy = _copy_of_deploy() / "variants" / variant.name
    if copy.exists():
        return copy
    src = _copy_of_deploy() / "overlays" / variant.overlay
    shutil.copytree(src, copy)
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    components = list(kustomization.get("components", []))
    for name in variant.drop:
        components.remove(f"../../components/{name}")
    components += [f"../../components/{name}" for name in variant.add]
    kustomization["components"] = components
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return copy


@functools.cache
def rendered_text(name: str) -> str:
    variant = next(v for v in VARIANTS if v.name == name)
    proc = subprocess.run(
        [kubectl(), "kustomize", str(_variant_dir(variant))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {name} failed:\n{proc.stderr}", pytrace=False)
    return proc.stdout


def render(name: str) -> list[dict[str, Any]]:
    """The resources of variant `name` (a fresh copy each call: tests may not share edits)."""
    return [doc for doc in yaml.safe_load_all(rendered_text(name)) if doc is not None]


# ---- reading the rendered resources -------------------------------------------------------------


@dataclass(frozen=True)
class PodTemplate:
    """A pod template of a workload (a Deployment, or one of a LeaderWorkerSet's two)."""

    owner: str  # kind/name[/leader|worker]
    labels: dict[str, str]
    spec: dict[str, Any]

    @property
    def containers(self) -> list[dict[str, Any]]:
        return self.spec["containers"]


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[PodTemplate]:
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Deployment":
            tpl = doc["spec"]["template"]
            yield PodTemplate(name, tpl["metadata"].get("labels", {}), tpl["spec"])
        elif doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                tpl = lwt[part]
                yield PodTemplate(f"{name}/{part}", tpl["metadata"]["labels"], tpl["spec"])


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def label_selector(selector: dict[str, Any]) -> dict[str, str]:
    """A selector's matchLabels; the manifests use no matchExpressions (refused here)."""
    assert set(selector) <= {"matchLabels"}, f"unexpected selector fields: {selector}"
    return selector["matchLabels"]


def container_port(container: dict[str, Any], port: int | str) -> int | None:
    """The container port `port` (a number, or a port name) resolves to, if declared."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def service_reaches(docs: list[dict[str, Any]], service: dict[str, Any], port: int) -> bool:
    """Service `service` has `port`, selects pods, and each declares the port it targets."""
    sp = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    pods = [t for t in pod_templates(docs) if selects(service["spec"]["selector"], t.labels)]
    if sp is None or not pods:
        return False
    target = sp.get("targetPort", port)
    return all(any(container_port(c, target) for c in t.containers) for t in pods)


# ---- what the services export ------------------------------------------------------------------

_METRIC = re.compile(r"\b(?:Gauge|Counter|Histogram|Summary)\(\s*\"([a-zA-Z_:][a-zA-Z0-9_:]*)\"")
# Each job (a Service's name, ServiceMonitor's default `job`) and the source it exports from.
_SOURCES = {
    "llmfleet-router": ["services/router", "shared/wire/metrics.py"],
    "llmfleet-worker": ["services/worker", "shared/wire/metrics.py"],
}


@functools.cache
def exported_metrics(job: str) -> frozenset[str]:
    """Metric names the service behind `job` defines (as prometheus_client takes them)."""
    names: set[str] = set()
    for rel in _SOURCES[job]:
        path = ROOT / "src" / "llmfleet" / rel
        for file in [path] if path.is_file() else sorted(path.glob("*.py")):
            names.update(_METRIC.findall(file.read_text()))
    return frozenset(names)


def metric_names(query: str) -> set[str]:
    """The metric names a PromQL query reads (names with a colon: the fleet's own)."""
    return set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", query))


def jobs_in(query: str) -> set[str]:
    return set(re.findall(r'job="([^"]+)"', query))
