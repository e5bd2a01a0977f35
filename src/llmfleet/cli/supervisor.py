"""Keep a local fleet's children running: a child that exits is started again, the rest serve on.

    sup = Supervisor(children, respawn, lock, min_backoff_s=0.5, max_backoff_s=30.0)
    sup.start()                  # a thread checks every child every `period_s`
    sup.stop()                   # before the fleet stops its children (no restart after)

A child that exits (crash, kill -9, exit status != 0 or 0) is started again with the same argv,
so at the same ports, after a backoff: `min_backoff_s` after its first exit, doubling with each
exit that follows a run shorter than `stable_s`, capped at `max_backoff_s`; a run of `stable_s`
or more resets it. A crash loop therefore costs one start every `max_backoff_s` at most. Every
restart is logged (with the exit status and the log's last lines) and counted in
`llmfleet:child_restarts_total{service, child}`, on the supervisor's own registry (`registry`;
`llmfleet up --metrics-port` serves it). Streams on a dead worker migrate through the router;
a restarted worker or router re-registers on its own (worker/registration.py).

`lock` is held while a child's process is replaced, so `Fleet.restart` and this thread never
restart one child twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import prometheus_client

from llmfleet.cli.fleet_plan import Child

logger = logging.getLogger(__name__)


class Supervisor:
    def __init__(
        self,
        children: Sequence[Child],
        respawn: Callable[[Child], None],
        lock: threading.Lock,
        *,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        stable_s: float = 30.0,
        period_s: float = 0.2,
    ) -> None:
        self._children = children
        self._respawn = respawn
        self._lock = lock
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.period_s = period_s
        self.registry = prometheus_client.CollectorRegistry()
        self.restarts_total = prometheus_client.Counter(
            "llmfleet:child_restarts",  # exposed as llmfleet:child_restarts_total
            "Children of the fleet started again after they exited",
            ["service", "child"],
            registry=self.registry,
        )
        self.num_restarts: dict[str, int] = {}  # child name -> restarts
        self._backoff: dict[str, float] = {}  # child name -> the next delay
        self._due: dict[str, float] = {}  # child name -> monotonic time of its restart
        self._started_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        now = time.monotonic()
        for c in self._children:
            self._started_at.setdefault(c.name, now)
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No restart after this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for c in list(self._children):
                try:
                    self._check(c)
                except OSError:  # could not start it (e.g. out of fds): try again later
                    logger.exception("restarting %s failed", c.name)
                    self._due[c.name] = time.monotonic() + self._next_backoff(c.name)

    def _check(self, c: Child) -> None:
        proc = c.proc
        if proc is None or proc.poll() is None:
            return
        now = time.monotonic()
        due = self._due.get(c.name)
        if due is None:
            if now - self._started_at.get(c.name, now) >= self.stable_s:
                self._backoff.pop(c.name, None)  # it ran fine for a while: not a crash loop
            delay = self._next_backoff(c.name)
            self._due[c.name] = now + delay
            logger.warning(
                "%s exited with status %s; restarting it in %.1f s (log: %s). Its last output:\n%s",
                c.name,
                proc.returncode,
                delay,
                c.log_path,
                c.output_tail(),
            )
            return
        if now < due:
            return
        with self._lock:
            if self._stop.is_set() or c.proc is not proc:  # stopping, or restarted meanwhile
                self._due.pop(c.name, None)
                return
            self._respawn(c)
        del self._due[c.name]
        self._started_at[c.name] = time.monotonic()
        self.num_restarts[c.name] = self.num_restarts.get(c.name, 0) + 1
        self.restarts_total.labels(c.kind, c.name).inc()
        logger.warning("%s restarted (pid %d)", c.name, c.proc.pid)  # type: ignore[union-attr]

    def _next_backoff(self, name: str) -> float:
        delay = self._backoff.get(name, self.min_backoff_s)
        self._backoff[name] = min(delay * 2, self.max_backoff_s)
        return delay
