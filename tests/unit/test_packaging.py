"""A non-editable install carries the whole package: every module and every data file the
code reads (tuned kernel configurations, the block-hash test vectors), at the paths the code
looks them up from."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """A wheel built from a copy of the checkout (the build leaves the tree alone)."""
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(tree)],
        check=True,
        capture_output=True,
    )
    [path] = out.glob("llmfleet-*.whl")
    return zipfile.ZipFile(path)


@pytest.fixture(scope="module")
def wheel_files(wheel: zipfile.ZipFile) -> set[str]:
    return set(wheel.namelist())


def _package_files(pattern: str) -> set[str]:
    src = ROOT / "src"
    return {
        p.relative_to(src).as_posix()
        for p in (src / "llmfleet").rglob(pattern)
        if "__pycache__" not in p.parts
    }


def test_wheel_has_every_module(wheel_files: set[str]) -> None:
    modules = _package_files("*.py")
    assert len(modules) > 100
    assert modules - wheel_files == set()


def test_wheel_has_every_data_file(wheel_files: set[str]) -> None:
    data = {f for f in _package_files("*") if not f.endswith((".py", ".pyc"))}
    data = {f for f in data if (ROOT / "src" / f).is_file()}
    assert "llmfleet/shared/core/block_hash_vectors.json" in data
    assert any(f.startswith("llmfleet/kernels/configs/fused_moe/") for f in data)
    assert data - wheel_files == set()


def test_wheel_has_the_console_script(wheel: zipfile.ZipFile) -> None:
    [name] = [f for f in wheel.namelist() if f.endswith(".dist-info/entry_points.txt")]
    lines = wheel.read(name).decode().splitlines()
    assert "llmfleet = llmfleet.cli.main:main" in lines
