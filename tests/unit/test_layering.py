"""The package's layering, checked on the real import graph.

Every module under src/llmfleet is imported (so the graph is of modules that exist and load),
and its imports are read from its source, including imports inside functions. The rules
(docs/architecture.md, "Layers"):

1. A module imports only from its own layer or the layers below it.
2. No service imports another service.
3. The layers under the wire (core), and kernels, models, engine and text, import neither
   grpc, protobuf nor ZMQ, nor the wire or the generated messages.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import llmfleet

# Lowest first. A module belongs to the layer of the longest package prefix that names it.
LAYERS: dict[str, tuple[str, ...]] = {
    "core": ("llmfleet.shared.core",),
    "wire": ("llmfleet.shared.wire", "llmfleet.v1"),
    "kernels": ("llmfleet.kernels",),
    "models": ("llmfleet.models",),
    "engine": ("llmfleet.engine",),
    "text": ("llmfleet.text",),
    "client": ("llmfleet.client",),
    "services": ("llmfleet.services",),
    "cli": ("llmfleet.cli",),
}
# Package docstrings only: they belong to no layer and import nothing.
LAYERLESS = ("llmfleet", "llmfleet.shared")
WIRE_FREE = ("core", "kernels", "models", "engine", "text")
WIRE_MODULES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "zmq")


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int


def layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = layer, len(p)
    return best


def service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["llmfleet", "services"] else None


def imports_of(module: str, path: Path) -> list[Edge]:
    """Every module `path` imports (absolute names; relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges += [Edge(module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            edges.append(Edge(module, base, node.lineno))
            # `from pkg import mod` imports the submodule pkg.mod when there is one.
            edges += [Edge(module, f"{base}.{a.name}", node.lineno) for a in node.names]
    return edges


def violations(edges: list[Edge], known: set[str]) -> list[str]:
    """The rule breaks among `edges`; `known` are the package's modules (an edge's target
    that is not a module, e.g. a class imported from one, is dropped)."""
    order = list(LAYERS)
    out = []
    for e in edges:
        target = e.imported
        where = f"{e.importer}:{e.line} imports {target}"
        src_layer = layer_of(e.importer)
        if src_layer in WIRE_FREE and any(
            target == w or target.startswith(w + ".") for w in WIRE_MODULES
        ):
            out.append(f"{where}: the {src_layer} layer does not touch the wire")
            continue
        if not target.startswith("llmfleet") or target not in known:
            continue
        dst_layer = layer_of(target)
        if src_layer is None or dst_layer is None:
            continue
        if order.index(dst_layer) > order.index(src_layer):
            out.append(f"{where}: {src_layer} is below {dst_layer}")
        elif src_layer in WIRE_FREE and dst_layer == "wire":
            out.append(f"{where}: the {src_layer} layer does not touch the wire")
        src_svc, dst_svc = service_of(e.importer), service_of(target)
        if src_svc and dst_svc and src_svc != dst_svc:
            out.append(f"{where}: service {src_svc} imports service {dst_svc}")
    return out


def package_modules(root: Path, prefix: str) -> dict[str, Path]:
    """{module name: source file} of every module under package directory `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([prefix, *parts])] = path
    return out


MODULES = package_modules(Path(llmfleet.__file__).parent, "llmfleet")


def test_every_module_has_a_layer():
    for name in MODULES:
        assert name in LAYERLESS or layer_of(name) is not None, name


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name: str):
    importlib.import_module(name)


def test_the_import_graph_follows_the_layers():
    known = set(MODULES) | {m.name for m in pkgutil.walk_packages(llmfleet.__path__, "llmfleet.")}
    edges = [e for name, path in MODULES.items() for e in imports_of(name, path)]
    assert len(edges) > 500  # the whole package was read
    assert violations(edges, known) == []


# ---- the checker itself fails on a wrong-way import ---------------------------------------


def _fake_package(tmp_path: Path, files: dict[str, str]) -> tuple[list[Edge], set[str]]:
    """A package `llmfleet` of `files` (path under it -> source; every folder a package)."""
    root = tmp_path / "llmfleet"
    for rel, text in files.items():
        path = root / rel
        for folder in [path.parent, *path.parent.parents]:
            if folder == root.parent:
                break
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "__init__.py").touch()
        path.write_text(text)
    modules = package_modules(root, "llmfleet")
    edges = [e for name, path in modules.items() for e in imports_of(name, path)]
    return edges, set(modules)


WRONG_WAY = {
    "engine/step.py": "def f():\n    from llmfleet.services.router import policy\n",
    "services/router/policy.py": "from llmfleet.engine import step\n",
}
SERVICE_TO_SERVICE = {
    "services/router/a.py": "from ..worker.b import x\n",
    "services/worker/b.py": "x = 1\n",
}
ENGINE_ON_THE_WIRE = {
    "engine/policy.py": "import grpc\nfrom llmfleet.shared.wire import convert\n",
    "shared/wire/convert.py": "",
}
WIRE = "the engine layer does not touch the wire"


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            WRONG_WAY,
            [
                "llmfleet.engine.step:2 imports llmfleet.services.router: engine is below services",
                "llmfleet.engine.step:2 imports llmfleet.services.router.policy: engine is below "
                "services",
            ],
        ),
        (
            SERVICE_TO_SERVICE,
            [
                "llmfleet.services.router.a:1 imports llmfleet.services.worker.b: service router "
                "imports service worker"
            ],
        ),
        (
            ENGINE_ON_THE_WIRE,
            [
                f"llmfleet.engine.policy:1 imports grpc: {WIRE}",
                f"llmfleet.engine.policy:2 imports llmfleet.shared.wire: {WIRE}",
                f"llmfleet.engine.policy:2 imports llmfleet.shared.wire.convert: {WIRE}",
            ],
        ),
    ],
    ids=["wrong-way", "service-to-service", "engine-on-the-wire"],
)
def test_the_checker_reports_each_rule_break(
    tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    edges, known = _fake_package(tmp_path, files)
    assert violations(edges, known) == expected
