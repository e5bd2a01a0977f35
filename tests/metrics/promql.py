"""Metric names used by the Grafana dashboard's PromQL, and the names our services export."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import prometheus_client

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmfleet-dashboard.json"

# Every module that defines Prometheus metrics (importing it registers them).
METRIC_MODULES = (
    "llmfleet.shared.wire.metrics",
    "llmfleet.services.router.metrics",
    "llmfleet.services.worker.outputs",
    "llmfleet.services.worker.kv_transfer",
    "llmfleet.services.worker.lease",
    "llmfleet.services.kvstore.runner",
    "llmfleet.services.tokenizer.server",
    "llmfleet.services.gateway.metrics",
)

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip
_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("_count", "_sum", "_created", ""),
    "gauge": ("",),
    "info": ("_info",),
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana variables allowed).

    Removed before looking for names: string literals, label matchers `{...}`, range and
    subquery brackets `[...]`, grouping clauses `by (...)` and the like, Grafana variables;
    of the identifiers left, those followed by `(` are functions, the rest metric names."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", s):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included."""
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", []) if "expr" in t]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            text = query.get("query", "") if isinstance(query, dict) else query
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", text or "")
            exprs.append(m.group(1) if m else text)
    return exprs


def dashboard_metric_names() -> set[str]:
    return {n for e in dashboard_exprs(load_dashboard()) for n in metric_names(e)}


def exported_names() -> set[str]:
    """Every sample name our services can expose (as scraped: `_total`, `_bucket`, ...)."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    return {
        family.name + suffix
        for family in prometheus_client.REGISTRY.collect()
        for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",))
    }
