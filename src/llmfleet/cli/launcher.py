"""Start a whole fleet on this machine as child processes (`llmfleet up`, and tests).

    with Fleet(FleetSpec(port=0, workers=2)) as fleet:
        client = GenerationClient(fleet.endpoint)
        fleet.worker_addresses            # gRPC addresses, e.g. for GetWorkerStats

Startup order (docs/fleet.md): kvstore and tokenizer (in parallel), then the router (waited
on until its health service answers: it reports SERVING only once workers registered), then
the workers (in parallel), then the router's SERVING, then (with `gateway`) the
OpenAI-compatible HTTP gateway, SERVING once its `/health` answers 200. Every child is
`sys.executable -m llmfleet.services.<name>` with explicit ports picked here. Each child's
stdout and stderr go to `<log_dir>/<name>.log` and, when `echo` is set, to this process's stderr
prefixed with `[name]`. A child that exits or is not SERVING in time fails the start with a
`FleetStartError` naming it and quoting the tail of its output.

Stopping sends SIGTERM tier by tier in reverse start order (gateway, workers, router,
tokenizer, kvstore), waits `stop_grace_s` per tier, then SIGKILLs what is left. Children run in
their own process group so a terminal's Ctrl-C reaches only the launcher, which then stops them
in order.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.shared.core.config import ROUTING_POLICIES
from llmfleet.shared.core.errors import LLMFleetError, ValidationError

logger = logging.getLogger(__name__)

MODULES = {
    "kvstore": "llmfleet.services.kvstore",
    "tokenizer": "llmfleet.services.tokenizer",
    "router": "llmfleet.services.router",
    "worker": "llmfleet.services.worker",
    "gateway": "llmfleet.services.gateway",
}
_TAIL_LINES = 40


class FleetStartError(LLMFleetError):
    """A child did not come up: it exited, or was not SERVING before the timeout."""


@dataclass(frozen=True)
class FleetSpec:
    """What to start. Unset engine options (model, device, dtype, quantization) take the
    services' defaults."""

    host: str = "127.0.0.1"
    port: int = 50051  # the public (router) port; 0: any free port
    disaggregated: bool = False
    workers: int = 1  # unified workers (aggregated mode)
    prefill_workers: int = 1  # disaggregated mode
    decode_workers: int = 1  # disaggregated mode
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    quantization: str | None = None  # "fp8": workers quantize their weights at load
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
    stop_grace_s: float = 15.0

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
        unknown = (set(self.extra_args) | set(self.modules)) - set(MODULES)
        if unknown:
            raise ValidationError("extra_args", f"unknown service kinds {sorted(unknown)}")
        if self.startup_timeout_s <= 0 or self.stop_grace_s < 0:
            raise ValidationError("startup_timeout_s", "timeouts must be positive")


@dataclass
class Child:
    """One started service process."""

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


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free right now (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As gRPC binds: a port in TIME_WAIT is usable, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Fleet:
    """A running fleet of child processes; a context manager (start on enter, stop on exit)."""

    def __init__(self, spec: FleetSpec | None = None) -> None:
        self.spec = spec or FleetSpec()
        self.children: list[Child] = []
        self.log_dir = Path(self.spec.log_dir or tempfile.mkdtemp(prefix="llmfleet-"))
        self._channels: dict[str, grpc.Channel] = {}
        self._started = False
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """Make a `start()` in progress give up (safe from a signal handler or another thread)."""
        self._interrupted.set()

    # ---- addresses ------------------------------------------------------------------------

    def child(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def endpoint(self) -> str:
        """The public endpoint (the router's `Generation` service)."""
        return self.child("router").address

    @property
    def router_address(self) -> str:
        return self.child("router").address

    @property
    def http_url(self) -> str | None:
        """The gateway's base URL (`http://HOST:PORT`, the API under `/v1`); None without one."""
        return f"http://{self.child('gateway').address}" if self.spec.gateway else None

    @property
    def tokenizer_address(self) -> str:
        return self.child("tokenizer").address

    @property
    def kvstore_address(self) -> str | None:
        return self.child("kvstore").address if self.spec.kvstore else None

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if c.kind == "worker"]

    @property
    def worker_addresses(self) -> list[str]:
        return [c.address for c in self.workers]

    # ---- plan -----------------------------------------------------------------------------

    def _plan(self) -> list[list[Child]]:
        """The children in start tiers, with every port chosen."""
        spec = self.spec
        h = spec.host
        roles = (
            ["prefill"] * spec.prefill_workers + ["decode"] * spec.decode_workers
            if spec.disaggregated
            else ["unified"] * spec.workers
        )
        ports = iter(pick_free_ports(2 * (4 + len(roles)) + 2, h))
        if spec.port == 0:
            public = next(ports)
        elif _port_is_free(h, spec.port):
            public = spec.port
        else:
            raise FleetStartError(f"port {spec.port} on {h} is in use (choose another with --port)")

        def make(
            name: str, kind: str, port: int, args: list[str], role: str | None = None
        ) -> Child:
            argv = [
                sys.executable,
                "-m",
                {**MODULES, **spec.modules}[kind],
                "--host",
                h,
                "--port",
                str(port),
                "--metrics-port",
                str(next(ports)),
                *args,
                *spec.extra_args.get(kind, ()),
            ]
            return Child(name, kind, f"{h}:{port}", argv, self.log_dir / f"{name}.log", role)

        engine: list[str] = []
        for flag, value in (
            ("--model", spec.model),
            ("--device", spec.device),
            ("--dtype", spec.dtype),
            ("--quantization", spec.quantization),
        ):
            if value is not None:
                engine += [flag, value]

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
                f"{h}:{kv_port}",
                "--kvstore-endpoint",
                f"tcp://{h}:{data_port}",
                "--kvstore-events",
                f"tcp://{h}:{events_port}",
            ]
        tokenizer_port = next(ports)
        tok_args = ["--model", spec.model] if spec.model is not None else []
        first.append(make("tokenizer", "tokenizer", tokenizer_port, tok_args))

        sched_args = ["--tokenizer", f"{h}:{tokenizer_port}"]
        sched_args += ["--mode", "disaggregated" if spec.disaggregated else "aggregated"]
        if spec.routing_policy is not None:
            sched_args += ["--routing-policy", spec.routing_policy]
        router = make("router", "router", public, sched_args)

        workers = []
        counts: dict[str, int] = collections.Counter()
        for role in roles:
            name = f"{'worker' if role == 'unified' else role}-{counts[role]}"
            counts[role] += 1
            args = ["--role", role, "--worker-id", name, "--router", router.address]
            workers.append(make(name, "worker", next(ports), [*args, *kv_args, *engine], role))
        gateways = []
        if spec.gateway:
            http = next(ports) if spec.http_port == 0 else spec.http_port
            if spec.http_port and not _port_is_free(h, http):
                raise FleetStartError(f"port {http} on {h} is in use (choose another: --http-port)")
            gw_args = ["--router", router.address, *tok_args]
            gateways.append(make("gateway", "gateway", http, gw_args))
        return [first, [router], workers, gateways]

    # ---- start / stop ---------------------------------------------------------------------

    def start(self) -> Fleet:
        if self._started:
            raise FleetStartError("this fleet was already started")
        self._started = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        tiers = self._plan()
        atexit.register(self.stop)
        try:
            deadline = time.monotonic() + self.spec.startup_timeout_s
            first, [router], workers, gateways = tiers
            self._spawn(first)
            self._wait(first, deadline, serving=True)
            self._spawn([router])
            self._wait([router], deadline, serving=False)
            self._spawn(workers)
            self._wait(workers, deadline, serving=True)
            self._wait([router], deadline, serving=True)
            self._spawn(gateways)
            self._wait(gateways, deadline, serving=True)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "fleet up: %s (logs in %s)",
            ", ".join(f"{c.name}={c.address}" for c in self.children),
            self.log_dir,
        )
        return self

    def _spawn(self, children: list[Child]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        for c in children:
            logger.debug("starting %s: %s", c.name, " ".join(c.argv))
            c.proc = subprocess.Popen(
                c.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                process_group=0,  # Ctrl-C in a terminal goes to the launcher only
            )
            self.children.append(c)
            c.pump = threading.Thread(
                target=_pump, args=(c, self.spec.echo), name=f"pump-{c.name}", daemon=True
            )
            c.pump.start()

    def _health(self, child: Child) -> int | None:
        """The child's overall health status, or None while it does not answer."""
        if child.kind == "gateway":
            return _http_health(child.address)
        channel = self._channels.get(child.name)
        if channel is None:
            channel = self._channels[child.name] = grpc.insecure_channel(child.address)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0).status
        except grpc.RpcError:
            return None

    def _wait(self, children: list[Child], deadline: float, *, serving: bool) -> None:
        """Until each child is SERVING (or, `serving` False, answers health at all)."""
        pending = list(children)
        while pending:
            for c in list(pending):
                code = c.proc.poll() if c.proc is not None else None
                if code is not None:
                    raise FleetStartError(
                        f"{c.name} exited with status {code} before it was serving "
                        f"(log: {c.log_path}); its last output:\n{c.output_tail()}"
                    )
                status = self._health(c)
                ok = health_pb2.HealthCheckResponse.SERVING
                if status is not None and (status == ok or not serving):
                    pending.remove(c)
            if not pending:
                return
            if self._interrupted.is_set():
                raise FleetStartError("start interrupted")
            if time.monotonic() > deadline:
                c = pending[0]
                what = "SERVING" if serving else "answering health checks"
                raise FleetStartError(
                    f"{c.name} was not {what} within {self.spec.startup_timeout_s:.0f} s "
                    f"(log: {c.log_path}); its last output:\n{c.output_tail()}"
                )
            time.sleep(0.1)

    def restart(self, name: str, *, kill: bool = True) -> Child:
        """Stop one child and start it again with the same flags and ports; returns once it is
        SERVING (a router: once workers registered with it again).

        `kill`: SIGKILL, as a crash would end it; otherwise SIGTERM and its drain."""
        c = self.child(name)
        if c.proc is not None and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                c.proc.wait(self.spec.stop_grace_s)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        if c.pump is not None:
            c.pump.join(5.0)
        self.children.remove(c)
        self._spawn([c])
        self._wait([c], time.monotonic() + self.spec.startup_timeout_s, serving=True)
        logger.info("%s restarted (pid %d)", c.name, c.proc.pid)  # type: ignore[union-attr]
        return c

    def poll(self) -> Child | None:
        """The first child that has exited, if any."""
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    def stop(self) -> None:
        """SIGTERM tier by tier in reverse start order; SIGKILL after the grace period."""
        atexit.unregister(self.stop)
        tiers: dict[str, list[Child]] = {
            "gateway": [],
            "worker": [],
            "router": [],
            "tokenizer": [],
            "kvstore": [],
        }
        for c in self.children:
            tiers[c.kind].append(c)
        for tier in tiers.values():
            live = [c for c in tier if c.proc is not None and c.proc.poll() is None]
            for c in live:
                logger.debug("stopping %s", c.name)
                c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            deadline = time.monotonic() + self.spec.stop_grace_s
            for c in live:
                try:
                    c.proc.wait(max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "%s did not stop within %.0f s: killing it", c.name, self.spec.stop_grace_s
                    )
                    c.proc.kill()  # type: ignore[union-attr]
                    c.proc.wait()  # type: ignore[union-attr]
        for c in self.children:
            if c.pump is not None:
                c.pump.join(timeout=2.0)
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def exit_codes(self) -> dict[str, int | None]:
        return {c.name: c.proc.returncode if c.proc else None for c in self.children}

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _http_health(address: str) -> int | None:
    """An HTTP child's health as gRPC's enum: GET /health 200 is SERVING."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=1.0) as resp:
            ok = resp.status == 200
    except urllib.error.HTTPError:
        ok = False
    except OSError:
        return None
    r = health_pb2.HealthCheckResponse
    return r.SERVING if ok else r.NOT_SERVING


def _pump(child: Child, echo: bool) -> None:
    """Copy the child's output to its log file (and stderr), keeping the last lines."""
    proc = child.proc
    if proc is None or proc.stdout is None:
        return
    with open(child.log_path, "ab") as log:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            child.tail.append(line)
            log.write(raw)
            log.flush()
            if echo:
                _write_line(sys.stderr, f"[{child.name}] {line}")
    proc.stdout.close()


_stderr_lock = threading.Lock()


def _write_line(stream: IO[str], line: str) -> None:
    with _stderr_lock:
        stream.write(line if line.endswith("\n") else line + "\n")
        stream.flush()


def run(
    spec: FleetSpec,
    *,
    out: IO[str] | None = None,
    session: Callable[[str], int] | None = None,
) -> int:
    """`llmfleet up`: start, print the endpoint, run until SIGINT/SIGTERM or a child dies.

    With `session` (e.g. an interactive chat), call it with the endpoint once the fleet serves
    and stop the fleet when it returns; its return value is the exit status.
    Returns the exit status: 0 after a requested stop, 1 when the fleet failed to start or a
    child exited on its own.
    """
    out = out or sys.stdout
    stop = threading.Event()
    fleet = Fleet(spec)
    in_session = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        fleet.interrupt()
        if in_session.is_set():
            raise KeyboardInterrupt  # a blocking read in the session would otherwise resume

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            fleet.start()
        except FleetStartError as exc:
            if stop.is_set():
                return 0
            _write_line(sys.stderr, f"llmfleet: the fleet did not start: {exc}")
            return 1
        print(f"llmfleet: serving on {fleet.endpoint}", file=out, flush=True)
        if fleet.http_url is not None:
            print(f"llmfleet: OpenAI-compatible API on {fleet.http_url}/v1", file=out, flush=True)
        if session is not None:
            in_session.set()
            try:
                return session(fleet.endpoint)
            except KeyboardInterrupt:
                return 0
            finally:
                in_session.clear()
        _write_line(sys.stderr, f"llmfleet: logs in {fleet.log_dir}; Ctrl-C stops the fleet")
        while not stop.wait(0.2):
            dead = fleet.poll()
            if dead is not None:
                _write_line(
                    sys.stderr,
                    f"llmfleet: {dead.name} exited with status {dead.proc.returncode} "  # type: ignore[union-attr]
                    f"(log: {dead.log_path}); stopping the fleet. Its last output:\n"
                    f"{dead.output_tail()}",
                )
                return 1
        _write_line(sys.stderr, "llmfleet: stopping")
        return 0
    finally:
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
