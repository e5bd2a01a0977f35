"""What a local fleet is made of: the `FleetSpec` a user asks for, and `plan`, which turns it
into the child processes to start, in start tiers, with every flag and port chosen.

Tiers (docs/fleet.md; started at once, waited for in this order): kvstore and tokenizer, then
the router, then the workers, then (with `gateway`) the OpenAI-compatible HTTP gateway. Every
child is `sys.executable -m llmfleet.services.<name>` (or `FleetSpec.modules[kind]`) with explicit
`--host`, `--port` and `--metrics-port`, the flags that wire it to the tiers before it, then
`FleetSpec.extra_args[kind]`. Ports are picked here, all distinct; the public (router) and HTTP
ports are the spec's unless 0, the metrics ports laid out from `metrics_port_base` when set.
Only the public and HTTP ports bind on `host`; every internal port (tokenizer, kvstore,
workers, the router's `--internal-port` Registry, where workers register) binds on
`internal_host`, and with `tls_dir` every internal service gets `--tls-dir`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmfleet.shared.core.config import ROUTING_POLICIES, EngineConfig
from llmfleet.shared.core.engine_flags import engine_argv
from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.core.speculative_settings import SpeculativeSettings

MODULES = {
    "kvstore": "llmfleet.services.kvstore",
    "tokenizer": "llmfleet.services.tokenizer",
    "router": "llmfleet.services.router",
    "worker": "llmfleet.services.worker",
    "gateway": "llmfleet.services.gateway",
}
_TAIL_LINES = 40
_PUBLIC = ("router", "gateway")  # bound on `host`; every other port on `internal_host`
_INTERNAL_TLS = ("kvstore", "tokenizer", "router", "worker")  # the kinds taking `--tls-dir`
_DRAINING = ("router", "worker", "gateway")  # the kinds with streams to finish: `--grace-s`
# The engine settings FleetSpec names itself (the tokenizer and gateway take the model too).
_OWN_FIELDS = ("model", "device", "dtype", "quantization")
# `FleetSpec.metrics_port_base`'s layout: these kinds' offsets, then worker i at METRICS_SLOTS + i.
METRICS_OFFSETS = {"kvstore": 0, "tokenizer": 1, "router": 2, "gateway": 3}
METRICS_SLOTS = len(METRICS_OFFSETS)


class FleetStartError(LLMFleetError):
    """A child did not come up: it exited, or was not SERVING before the timeout."""


@dataclass(frozen=True)
class FleetSpec:
    """What to start. Unset engine options (model, device, dtype, quantization) take the
    services' defaults."""

    host: str = "127.0.0.1"  # the public ports' address: router Generation, gateway HTTP
    port: int = 50051  # the public (router) port; 0: any free port
    # Every internal port (tokenizer, kvstore, workers, the router's Registry and reply
    # endpoint) binds here, apart from the public ones.
    internal_host: str = "127.0.0.1"
    # Mutual TLS on internal gRPC and CURVE on ZMQ with these credentials (`llmfleet tls
    # init DIR`, shared/wire/tls.py), passed to every child as `--tls-dir`; None: plaintext.
    tls_dir: str | None = None
    disaggregated: bool = False
    workers: int = 1  # unified workers (aggregated mode)
    prefill_workers: int = 1  # disaggregated mode
    decode_workers: int = 1  # disaggregated mode
    model: str | None = None
    device: str | None = None
    # Worker i's device, in `plan`'s order (prefill workers, then decode ones), over `device`:
    # ("cuda:0", "cuda:1") puts a disaggregated fleet's prefill on GPU 0 and decode on GPU 1.
    # Empty: `device` for every worker (tensor-parallel ones get GPUs of their own).
    worker_devices: Sequence[str] = ()
    dtype: str | None = None
    quantization: str | None = None  # "fp8": workers quantize their weights at load
    # Every other EngineConfig field the workers take, by name, e.g. {"max_num_seqs": 256,
    # "simulate": True}; unset fields take the workers' defaults.
    engine: Mapping[str, Any] = field(default_factory=dict)
    # Speculative decoding, for the decode and unified workers (prefill workers never draft).
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    routing_policy: str | None = None
    kvstore: bool = True
    gateway: bool = False  # the OpenAI-compatible HTTP gateway (`llmfleet up` starts it)
    http_port: int = 8000  # the gateway's port; 0: any free port
    # Extra flags per kind ("kvstore", "tokenizer", "router", "worker", "gateway"), e.g.
    # {"worker": ["--num-kv-blocks", "64"]}.
    extra_args: Mapping[str, Sequence[str]] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)  # added to this process's environment
    modules: Mapping[str, str] = field(default_factory=dict)  # kind -> module, over MODULES
    log_dir: str | None = None  # None: a fresh temporary directory
    echo: bool = False  # copy children's output to this process's stderr
    startup_timeout_s: float = 300.0
    # On stop, the router, workers and gateway finish open streams for this long (`--grace-s`).
    grace_s: float = 30.0
    stop_grace_s: float | None = None  # then SIGKILL per tier; None: grace_s + 10
    supervise: bool = True  # start again a child that exits (supervisor.py)
    restart_backoff_s: float = 0.5  # the first restart's delay; doubles per crash, capped:
    max_restart_backoff_s: float = 30.0
    metrics_port: int | None = None  # the supervisor's /metrics (restarts); 0: any; None: none
    # The children's own /metrics ports: kvstore BASE, tokenizer BASE+1, router BASE+2, gateway
    # BASE+3, worker i (in `plan`'s order) BASE+4+i; None: free ports.
    metrics_port_base: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValidationError("port", f"must be in [0, 65535], got {self.port}")
        if not 0 <= self.http_port < 65536:
            raise ValidationError("http_port", f"must be in [0, 65535], got {self.http_port}")
        for name in ("workers", "prefill_workers", "decode_workers"):
            if getattr(self, name) < 1:
                raise ValidationError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.routing_policy is not None and self.routing_policy not in ROUTING_POLICIES:
            raise ValidationError("routing_policy", f"must be one of {', '.join(ROUTING_POLICIES)}")
        engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {
            *_OWN_FIELDS,
            "speculative",  # FleetSpec.speculative says it
        }
        if set(self.engine) - engine_fields:
            unknown = sorted(set(self.engine) - engine_fields)
            raise ValidationError("engine", f"not engine settings here: {unknown}")
        unknown = (set(self.extra_args) | set(self.modules)) - set(MODULES)
        if unknown:
            raise ValidationError("extra_args", f"unknown service kinds {sorted(unknown)}")
        if self.startup_timeout_s <= 0:
            raise ValidationError("startup_timeout_s", "must be > 0")
        if self.grace_s < 0 or (self.stop_grace_s is not None and self.stop_grace_s < 0):
            raise ValidationError("grace_s", "must be >= 0")
        top = METRICS_SLOTS + self.num_workers - 1
        if self.metrics_port_base is not None and not 0 < self.metrics_port_base < 65536 - top:
            raise ValidationError(
                "metrics_port_base", f"must be in [1, {65535 - top}] (it and the {top} after it)"
            )
        if self.worker_devices and len(self.worker_devices) != self.num_workers:
            raise ValidationError(
                "worker_devices",
                f"{len(self.worker_devices)} devices for {self.num_workers} workers",
            )
        if not 0 < self.restart_backoff_s <= self.max_restart_backoff_s:
            raise ValidationError("restart_backoff_s", "must be > 0 and <= max_restart_backoff_s")

    @property
    def num_workers(self) -> int:
        return self.prefill_workers + self.decode_workers if self.disaggregated else self.workers


@dataclass
class Child:
    """One service process: planned here (name, address, argv); the launcher fills in its
    process and the pump thread that reads its output."""

    name: str  # "kvstore", "tokenizer", "router", "worker-0", "prefill-0", "decode-1", ...
    kind: str  # key of FleetSpec.modules
    address: str  # its gRPC address
    argv: list[str]
    log_path: Path
    role: str | None = None  # workers: unified | prefill | decode
    proc: subprocess.Popen[bytes] | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=200))
    pump: threading.Thread | None = None

    @property
    def metrics_url(self) -> str:
        """Its Prometheus endpoint (the `--metrics-port` the launcher picked)."""
        host = self.address.rsplit(":", 1)[0]
        return f"http://{host}:{self.argv[self.argv.index('--metrics-port') + 1]}/metrics"

    def output_tail(self, lines: int = _TAIL_LINES) -> str:
        if self.pump is not None:
            self.pump.join(timeout=1.0)  # an exited child: let the pump read its last lines
        return "".join(list(self.tail)[-lines:]).rstrip()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (and of binds to 0)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_PORT_RNG = random.SystemRandom()  # not the global generator: tests seed that one
_handed_out: collections.deque[int] = collections.deque(maxlen=4096)


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free right now (held open together so none repeats), none of
    them handed out by an earlier call of this process (its child may not have bound it yet).

    A child binds its port a little later, so the ports come from below the ephemeral range
    where the kernel can: there no outgoing connection in the meantime (the fleet's own
    services connecting to each other) can take one as its local port."""
    recent = set(_handed_out)
    socks: list[socket.socket] = []
    try:
        for port in _port_candidates(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            if s.getsockname()[1] in recent:
                s.close()
                continue
            socks.append(s)
            if len(socks) == count:
                break
        ports = [s.getsockname()[1] for s in socks]
        _handed_out.extend(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def _port_candidates(count: int) -> Iterator[int]:
    """Random ports below the ephemeral range where it leaves room, then 0 (the kernel's
    choice) for as long as it takes."""
    lo, _ = _ephemeral_range()
    if lo > 10000 + 4 * count:
        yield from _PORT_RNG.sample(range(10000, lo), min(lo - 10000, 64 * count))
    yield from itertools.repeat(0)


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As gRPC binds: a port in TIME_WAIT is usable, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def plan(spec: FleetSpec, log_dir: Path) -> list[list[Child]]:
    """The children in start tiers ([kvstore and tokenizer], [router], workers, [gateway] or
    []), with every port chosen; each logs to `<log_dir>/<name>.log`. Raises
    `FleetStartError` when the spec's public or HTTP port is in use."""
    h, ih = spec.host, spec.internal_host
    roles = (
        ["prefill"] * spec.prefill_workers + ["decode"] * spec.decode_workers
        if spec.disaggregated
        else ["unified"] * spec.workers
    )
    ports = iter(pick_free_ports(2 * (4 + len(roles)) + 3, h))
    if spec.port == 0:
        public = next(ports)
    elif _port_is_free(h, spec.port):
        public = spec.port
    else:
        raise FleetStartError(f"port {spec.port} on {h} is in use (choose another with --port)")

    def metrics_port(kind: str, bind: str, worker: int) -> int:
        if spec.metrics_port_base is None:
            return next(ports)
        port = spec.metrics_port_base + METRICS_OFFSETS.get(kind, METRICS_SLOTS + worker)
        if not _port_is_free(bind, port):
            raise FleetStartError(
                f"metrics port {port} on {bind} is in use (choose another --metrics-port-base)"
            )
        return port

    def make(
        name: str, kind: str, port: int, args: list[str], role: str | None = None, worker: int = 0
    ) -> Child:
        bind = h if kind in _PUBLIC else ih
        tls = ["--tls-dir", spec.tls_dir] if spec.tls_dir and kind in _INTERNAL_TLS else []
        argv = [
            sys.executable,
            "-m",
            {**MODULES, **spec.modules}[kind],
            "--host",
            bind,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port(kind, bind, worker)),
            *args,
            *tls,
            *(["--grace-s", str(spec.grace_s)] if kind in _DRAINING else []),
            *spec.extra_args.get(kind, ()),
        ]
        return Child(name, kind, f"{bind}:{port}", argv, log_dir / f"{name}.log", role)

    own = {f: getattr(spec, f) for f in _OWN_FIELDS}
    engine = _share_cores({**own, **spec.engine}, len(roles))

    first: list[Child] = []
    kv_args: list[str] = []
    if spec.kvstore:
        kv_port, data_port, events_port = next(ports), next(ports), next(ports)
        first.append(
            make(
                "kvstore",
                "kvstore",
                kv_port,
                ["--data-port", str(data_port), "--events-port", str(events_port)],
            )
        )
        kv_args = [
            "--kvstore",
            f"{ih}:{kv_port}",
            "--kvstore-endpoint",
            f"tcp://{ih}:{data_port}",
            "--kvstore-events",
            f"tcp://{ih}:{events_port}",
        ]
    tokenizer_port = next(ports)
    tok_args = ["--model", spec.model] if spec.model is not None else []
    first.append(make("tokenizer", "tokenizer", tokenizer_port, tok_args))

    registry = f"{ih}:{next(ports)}"  # the router's internal port: workers register there
    sched_args = ["--tokenizer", f"{ih}:{tokenizer_port}"]
    sched_args += ["--internal-host", ih, "--internal-port", registry.rsplit(":", 1)[1]]
    sched_args += ["--mode", "disaggregated" if spec.disaggregated else "aggregated"]
    if spec.kvstore:  # the router's view of the store, for routing (what a fetch can bring)
        sched_args += [kv_args[0], kv_args[1], kv_args[4], kv_args[5]]
    if spec.routing_policy is not None:
        sched_args += ["--routing-policy", spec.routing_policy]
    router = make("router", "router", public, sched_args)

    workers = []
    counts: dict[str, int] = collections.Counter()
    for i, role in enumerate(roles):
        name = f"{'worker' if role == 'unified' else role}-{counts[role]}"
        counts[role] += 1
        args = ["--role", role, "--worker-id", name, "--router", registry]
        if spec.worker_devices:
            mine = {**engine, "device": spec.worker_devices[i]}
        else:
            mine = _own_gpus(engine, i)
        args += [*kv_args, *engine_argv(mine)]
        if role != "prefill":
            args += spec.speculative.argv()
        workers.append(make(name, "worker", next(ports), args, role, worker=i))
    gateways = []
    if spec.gateway:
        http = next(ports) if spec.http_port == 0 else spec.http_port
        if spec.http_port and not _port_is_free(h, http):
            raise FleetStartError(f"port {http} on {h} is in use (choose another: --http-port)")
        gw_args = ["--router", router.address, *tok_args]
        gateways.append(make("gateway", "gateway", http, gw_args))
    return [first, [router], workers, gateways]


def _own_gpus(engine: dict[str, Any], index: int) -> dict[str, Any]:
    """Worker `index`'s engine settings: a tensor-parallel CUDA worker of N ranks gets GPUs of
    its own, cuda:(base + index * N) on (rank r on the r-th after it); others share the one."""
    tp = engine.get("tensor_parallel_size") or 1
    device = str(engine.get("device") or "cpu")
    if tp < 2 or not device.startswith("cuda"):
        return engine
    base = int(device.partition(":")[2] or 0)
    return {**engine, "device": f"cuda:{base + index * tp}"}


def _share_cores(engine: dict[str, Any], num_workers: int) -> dict[str, Any]:
    """CPU workers split this machine's cores instead of each taking all of them: torch's
    default is one thread per core per process, and two such workers stepping at once
    oversubscribe the cores (spinning OpenMP threads preempt each other), several times slower
    than one thread each. Each rank of a tensor-parallel worker is such a process. An explicit
    `num_threads` stands; GPU and simulated workers keep theirs."""
    on_cpu = not str(engine.get("device") or "cpu").startswith("cuda")
    processes = num_workers * (engine.get("tensor_parallel_size") or 1)
    if processes < 2 or engine.get("num_threads") or engine.get("simulate") or not on_cpu:
        return engine
    return {**engine, "num_threads": max(1, (os.cpu_count() or 1) // processes)}
