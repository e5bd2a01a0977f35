"""`SeededCacheManager`: Triton finds a native module built ahead of time (the CUDA image's seed)
without a C compiler, and writes what it compiles to its own cache, never to the seed.

The end-to-end test goes through Triton's own compile-and-cache path (`compile_so_from_src`, the
path its CUDA driver module takes): one process compiles into a cache that becomes the seed;
another, whose C compiler is `false`, gets the seeded library and calls it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from triton.runtime.cache import get_cache_manager  # noqa: E402

from llmfleet.kernels.triton_cache import SEED_DIR_ENV, SeededCacheManager  # noqa: E402

pytestmark = pytest.mark.timeout(60)

MANAGER = "llmfleet.kernels.triton_cache:SeededCacheManager"
KEY, OTHER_KEY = (hashlib.sha256(s).hexdigest() for s in (b"a source", b"another source"))
PROBE = """
import ctypes, sys
from triton.runtime.build import compile_so_from_src
path = compile_so_from_src("int answer(void) { return 42; }", "llmfleet_probe")
print(path)
print(ctypes.CDLL(path).answer())
"""


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    cache, seed = tmp_path / "cache", tmp_path / "seed"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", MANAGER)
    monkeypatch.setenv(SEED_DIR_ENV, str(seed))
    return cache, seed


def test_a_miss_falls_back_on_the_seed_and_writes_go_to_the_cache(
    dirs: tuple[Path, Path],
) -> None:
    cache, seed = dirs
    manager = get_cache_manager(KEY)
    assert isinstance(manager, SeededCacheManager)
    assert manager.get_file("mod.so") is None
    (seed / manager.key).mkdir(parents=True)
    (seed / manager.key / "mod.so").write_bytes(b"seeded")
    assert manager.get_file("mod.so") == str(seed / manager.key / "mod.so")
    assert get_cache_manager(OTHER_KEY).get_file("mod.so") is None  # keyed like the cache
    written = manager.put(b"compiled", "mod.so", binary=True)
    assert Path(written).parent == cache / manager.key
    assert manager.get_file("mod.so") == written  # the cache first
    assert (seed / manager.key / "mod.so").read_bytes() == b"seeded"


def test_without_the_seed_variable_the_seed_is_not_read(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, seed = dirs
    key = get_cache_manager(KEY).key
    (seed / key).mkdir(parents=True)
    (seed / key / "mod.so").write_bytes(b"seeded")
    monkeypatch.delenv(SEED_DIR_ENV)
    assert get_cache_manager(KEY).get_file("mod.so") is None


def test_a_process_without_a_compiler_loads_the_seeded_module(tmp_path: Path) -> None:
    if shutil.which("gcc") is None and shutil.which("clang") is None:
        pytest.skip("building the seed needs a C compiler (gcc or clang)")
    seed = tmp_path / "seed"
    build = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "TRITON_CACHE_DIR": str(seed)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert build.returncode == 0, build.stderr
    built, answer = build.stdout.split()
    assert answer == "42" and Path(built).is_relative_to(seed)

    env = {
        **os.environ,
        "CC": "false",  # any compile fails
        "TRITON_CACHE_DIR": str(tmp_path / "cache"),
        "TRITON_CACHE_MANAGER": MANAGER,
        SEED_DIR_ENV: str(seed),
    }
    run = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [built, "42"]

    plain = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={k: v for k, v in env.items() if k != "TRITON_CACHE_MANAGER"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode != 0  # Triton's own cache misses and cannot compile
