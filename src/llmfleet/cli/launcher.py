"""Run a fleet on this machine as child processes and supervise them (`llmfleet up`, tests).

    with Fleet(FleetSpec(port=0, workers=2)) as fleet:
        client = GenerationClient(fleet.endpoint)
        fleet.worker_addresses            # gRPC addresses, e.g. for GetWorkerStats

`Fleet.start` starts every child of `fleet_plan.plan` at once (their ports are all chosen, and
each service waits for or retries what it needs from the others), then waits for them tier by
tier: kvstore and tokenizer SERVING, the router answering its health service (it reports
SERVING only once workers registered), the workers SERVING, the router SERVING, then the
gateway, SERVING once its `/health` answers 200. Each child's stdout and stderr go to
`<log_dir>/<name>.log` and, when `echo` is set, to this process's stderr prefixed with `[name]`
(whole lines, through `write_line`). A child that exits or is not SERVING in time fails the
start with a `FleetStartError` naming it and quoting the tail of its output.

Once started, with `FleetSpec.supervise`, a `Supervisor` (supervisor.py) starts again any child
that exits, with the same flags and ports, after a capped exponential backoff, while the rest
serve on; restarts are counted in `llmfleet:child_restarts_total{service, child}`, served on
`FleetSpec.metrics_port` (`metrics_url`) when set.

Stopping sends SIGTERM tier by tier in reverse start order (gateway, workers, router,
tokenizer, kvstore): each child drains (NOT_SERVING, new requests refused, open streams finish
within its `--grace-s`, `FleetSpec.grace_s`); what is left after `stop_grace_s` per tier is
SIGKILLed. Children run in their own process group so a terminal's Ctrl-C reaches only the
launcher, which then stops them in order.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import grpc
import prometheus_client
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.cli.fleet_plan import Child, FleetSpec, FleetStartError, plan
from llmfleet.cli.supervisor import Supervisor
from llmfleet.shared.wire import tls

logger = logging.getLogger(__name__)


class Fleet:
    """A running fleet of child processes; a context manager (start on enter, stop on exit)."""

    def __init__(self, spec: FleetSpec | None = None) -> None:
        self.spec = spec or FleetSpec()
        self.children: list[Child] = []
        self.log_dir = Path(self.spec.log_dir or tempfile.mkdtemp(prefix="llmfleet-"))
        self._channels: dict[str, grpc.Channel] = {}
        self._tls = tls.load(self.spec.tls_dir)  # health checks of internal children: mTLS
        self._started = False
        self._interrupted = threading.Event()
        self._lock = threading.Lock()  # held while a child's process is replaced
        self.supervisor: Supervisor | None = None
        self.metrics_url: str | None = None  # the supervisor's /metrics (restart counts)
        self._metrics_httpd: Any = None

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
    def registry_address(self) -> str:
        """The router's internal port, where workers register."""
        argv = self.child("router").argv
        host, port = (argv[argv.index(flag) + 1] for flag in ("--internal-host", "--internal-port"))
        return f"{host}:{port}"

    @property
    def http_url(self) -> str | None:
        """The gateway's base URL (`http://HOST:PORT`, the API under `/v1`); None without one."""
        return f"http://{self.child('gateway').address}" if self.spec.gateway else None

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each child's Prometheus endpoint by name, in start order; the gateway's is its HTTP
        port's /metrics, where the fleet's GIE gauges are (as a model server's, for a scraper
        that looks there; its own metrics port serves the same)."""
        return {
            c.name: f"{self.http_url}/metrics" if c.kind == "gateway" else c.metrics_url
            for c in self.children
        }

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

    # ---- start / stop ---------------------------------------------------------------------

    def start(self) -> Fleet:
        if self._started:
            raise FleetStartError("this fleet was already started")
        self._started = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        tiers = plan(self.spec, self.log_dir)
        atexit.register(self.stop)
        try:
            deadline = time.monotonic() + self.spec.startup_timeout_s
            first, [router], workers, gateways = tiers
            self._spawn([*first, router, *workers, *gateways])  # every port is chosen already
            self._wait(first, deadline, serving=True)
            self._wait([router], deadline, serving=False)
            self._wait(workers, deadline, serving=True)
            self._wait([router], deadline, serving=True)
            self._wait(gateways, deadline, serving=True)
        except BaseException:
            self.stop()
            raise
        if self.spec.supervise:
            self.supervisor = Supervisor(
                self.children,
                self._launch,
                self._lock,
                min_backoff_s=self.spec.restart_backoff_s,
                max_backoff_s=self.spec.max_restart_backoff_s,
            )
            self.supervisor.start()
            if self.spec.metrics_port is not None:
                httpd, _ = prometheus_client.start_http_server(
                    self.spec.metrics_port, addr=self.spec.host, registry=self.supervisor.registry
                )
                self._metrics_httpd = httpd
                self.metrics_url = f"http://{self.spec.host}:{httpd.server_port}/metrics"
        logger.info(
            "fleet up: %s (logs in %s)",
            ", ".join(f"{c.name}={c.address}" for c in self.children),
            self.log_dir,
        )
        return self

    def _spawn(self, children: list[Child]) -> None:
        for c in children:
            self._launch(c)
            self.children.append(c)

    def _launch(self, c: Child) -> None:
        """Start the child's process (again: same argv, same ports) and its output pump."""
        if c.pump is not None:
            c.pump.join(5.0)  # the previous process's last lines
        logger.debug("starting %s: %s", c.name, " ".join(c.argv))
        c.proc = subprocess.Popen(
            c.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env},
            process_group=0,  # Ctrl-C in a terminal goes to the launcher only
        )
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
            internal = self._tls if child.kind != "router" else None  # the public port: plain
            channel = self._channels[child.name] = tls.channel(child.address, internal)
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
        with self._lock:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
                try:
                    c.proc.wait(self.stop_grace_s)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
            self._launch(c)
        self._wait([c], time.monotonic() + self.spec.startup_timeout_s, serving=True)
        logger.info("%s restarted (pid %d)", c.name, c.proc.pid)  # type: ignore[union-attr]
        return c

    def poll(self) -> Child | None:
        """The first child that has exited, if any."""
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    @property
    def stop_grace_s(self) -> float:
        """How long a stopping child may take before it is killed."""
        s = self.spec
        return s.stop_grace_s if s.stop_grace_s is not None else s.grace_s + 10.0

    def num_restarts(self, name: str) -> int:
        """How often the supervisor started child `name` again."""
        return self.supervisor.num_restarts.get(name, 0) if self.supervisor else 0

    def stop(self) -> None:
        """SIGTERM tier by tier in reverse start order (each drains within its grace);
        SIGKILL after `stop_grace_s`. No child is restarted once this has begun."""
        atexit.unregister(self.stop)
        if self.supervisor is not None:
            self.supervisor.stop()
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
            self._metrics_httpd = None
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
            deadline = time.monotonic() + self.stop_grace_s
            for c in live:
                try:
                    c.proc.wait(max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "%s did not stop within %.0f s: killing it", c.name, self.stop_grace_s
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
                write_line(sys.stderr, f"[{child.name}] {line}")
    proc.stdout.close()


_stderr_lock = threading.Lock()


def write_line(stream: IO[str], line: str) -> None:
    """Write one whole line: echoed children's output and `llmfleet up`'s messages never mix."""
    with _stderr_lock:
        stream.write(line if line.endswith("\n") else line + "\n")
        stream.flush()
