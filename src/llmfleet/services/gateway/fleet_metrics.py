"""The fleet's load on the gateway's `/metrics`, under the names the Gateway API Inference
Extension (GIE) model-server protocol reads, so that an endpoint picker can treat a whole fleet
behind one gateway as one model server:

    vllm:num_requests_waiting{model_name="m"} 3.0                  <- the fleet (first sample)
    vllm:num_requests_waiting{model_name="m",worker="worker-0"} 1.0
    vllm:num_requests_waiting{model_name="m",worker="worker-1"} 2.0

and the same for `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (used KV blocks
over all blocks, 0..1), plus `vllm:lora_requests_info` (no adapters: `max_lora="0"`). GIE's
scraper takes a family's first sample unless its metric spec names labels, so the fleet total
comes first, then one sample per worker (`vllm:num_requests_waiting{worker="decode-0"}` picks
one).

The values are the workers' load reports as the router holds them (`GetServerInfo`, refreshed
by heartbeats), fetched at scrape time and cached for `ttl_s`: a scraper polling every 50 ms
costs the router one call per `ttl_s`. A scrape waits at most `timeout_s` for the router (one
fetch at a time, shared by concurrent scrapes); when the router does not answer, the last
values are served while younger than `stale_s`, after which the gauges are left out (and
`llmfleet:gateway_fleet_load_errors_total` counts the failures) rather than served stale.

The gateway's process may hold services' own `vllm:*` gauges (tests run several services in
one process), so rendering replaces any family of the same name from the default registry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from llmfleet.client.messages import ServerInfo, WorkerStatus
from llmfleet.services.gateway.upstream import Upstream

logger = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
LORA_INFO = "vllm:lora_requests_info"
_NAMES = frozenset({WAITING, RUNNING, KV_USAGE, LORA_INFO})
_RPC_TIMEOUT_S = 5.0  # a fetch left running past a scrape's wait ends by this

LOAD_ERRORS = prometheus_client.Counter(
    "llmfleet:gateway_fleet_load_errors_total",
    "Scrapes of the gateway's /metrics that could not get the fleet's load from the router",
)


@dataclass(frozen=True)
class FleetLoad:
    """What the router reported, and when."""

    model_name: str
    workers: list[WorkerStatus]
    at: float  # time.monotonic() of the fetch


class FleetGauges:
    """The fleet gauges of one gateway; `render` is the whole `/metrics` body.

    Use from the gateway's event loop (`render`), or from another thread (`collect`, the
    `prometheus_client` registry interface, for the gateway's own metrics port) once `bind`
    has named that loop."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[tuple[str, ServerInfo]]],
        *,
        ttl_s: float = 0.25,
        timeout_s: float = 0.5,
        stale_s: float = 5.0,
    ) -> None:
        """`fetch`: the served model's name and the router's server info."""
        self._fetch = fetch
        self.ttl_s, self.timeout_s, self.stale_s = ttl_s, timeout_s, stale_s
        self._last: FleetLoad | None = None
        self._inflight: asyncio.Task[FleetLoad] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The event loop that `collect` runs fetches on (None: `collect` serves the cache)."""
        self._loop = loop

    async def render(self) -> bytes:
        """The Prometheus text of this process's registry with the fleet gauges in it."""
        return prometheus_client.generate_latest(_Merged(await self.load()))  # type: ignore[arg-type]

    def collect(self) -> Iterator[Metric]:
        """Registry interface for a thread outside the loop (blocks at most `timeout_s`)."""
        load = self._last
        loop = self._loop
        if loop is not None and not loop.is_closed():
            future = asyncio.run_coroutine_threadsafe(self.load(), loop)
            try:
                load = future.result(self.timeout_s + 0.5)
            except (concurrent.futures.TimeoutError, RuntimeError):
                future.cancel()
                load = self._fresh_enough()
        yield from _Merged(load).collect()

    async def load(self) -> FleetLoad | None:
        """The fleet's load: cached, fetched, or (router slow or down) the last if not stale."""
        now = time.monotonic()
        if self._last is not None and now - self._last.at < self.ttl_s:
            return self._last
        task = self._inflight
        if task is None or task.done():
            task = self._inflight = asyncio.create_task(self._get())
            task.add_done_callback(_log_failure)  # (also marks its exception retrieved)
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if done and not task.cancelled() and task.exception() is None:
            self._last = task.result()
            return self._last
        LOAD_ERRORS.inc()
        return self._fresh_enough()

    def _fresh_enough(self) -> FleetLoad | None:
        last = self._last
        return last if last is not None and time.monotonic() - last.at < self.stale_s else None

    async def _get(self) -> FleetLoad:
        model_name, info = await self._fetch()
        return FleetLoad(model_name, list(info.workers), time.monotonic())


def _log_failure(task: asyncio.Task[FleetLoad]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("the fleet's load is unavailable: %s", task.exception())


async def router_load(upstream: Upstream) -> tuple[str, ServerInfo]:
    """The served model's name and the router's view of its workers."""
    served = await upstream.model()
    return served.name, await upstream.client.server_info(timeout=_RPC_TIMEOUT_S)


def families(load: FleetLoad) -> list[Metric]:
    """The GIE gauges of `load`: each family's fleet sample first, then one per worker."""
    model = {"model_name": load.model_name}
    used = [w.num_total_blocks - w.num_free_blocks for w in load.workers]
    total_blocks = sum(w.num_total_blocks for w in load.workers)
    rows = {
        WAITING: (
            "Requests waiting to be scheduled: the fleet's (no worker label), then each worker's",
            [float(w.num_waiting) for w in load.workers],
            float(sum(w.num_waiting for w in load.workers)),
        ),
        RUNNING: (
            "Requests running in an engine: the fleet's (no worker label), then each worker's",
            [float(w.num_running) for w in load.workers],
            float(sum(w.num_running for w in load.workers)),
        ),
        KV_USAGE: (
            "Fraction of KV blocks in use (0..1): the fleet's (no worker label), then each "
            "worker's",
            [
                u / w.num_total_blocks if w.num_total_blocks else 0.0
                for u, w in zip(used, load.workers, strict=True)
            ],
            sum(used) / total_blocks if total_blocks else 0.0,
        ),
    }
    out: list[Metric] = []
    for name, (doc, per_worker, fleet) in rows.items():
        family = GaugeMetricFamily(name, doc)
        family.samples.append(Sample(name, dict(model), fleet))
        for w, value in zip(load.workers, per_worker, strict=True):
            family.samples.append(Sample(name, {**model, "worker": w.worker_id}, value))
        out.append(family)
    lora = GaugeMetricFamily(LORA_INFO, "LoRA adapters running and waiting (none: no LoRA)")
    labels = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    lora.samples.append(Sample(LORA_INFO, labels, time.time()))
    out.append(lora)
    return out


class _Merged:
    """The default registry's families, those named like the fleet gauges replaced."""

    def __init__(self, load: FleetLoad | None) -> None:
        self._load = load

    def collect(self) -> Iterator[Metric]:
        for family in prometheus_client.REGISTRY.collect():
            if family.name not in _NAMES:
                yield family
        if self._load is not None:
            yield from families(self._load)
