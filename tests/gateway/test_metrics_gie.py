"""The gateway's fleet gauges (fleet_metrics.py) over a stand-in for the router's GetServerInfo:
GIE's names and sample order, the fleet sums, the cache, and a slow or dead router bounding the
scrape. The real fleet is in test_gateway_fleet.py (the URL `llmfleet up` prints)."""

from __future__ import annotations

import asyncio
import threading
import time

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from llmfleet.client.messages import ServerInfo, WorkerStatus
from llmfleet.services.gateway.fleet_metrics import LOAD_ERRORS, FleetGauges
from llmfleet.shared.wire.metrics import NUM_REQUESTS_RUNNING

GIE = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def worker(name: str, running: int, waiting: int, free: int, total: int) -> WorkerStatus:
    return WorkerStatus(name, "unified", f"{name}:1", running, waiting, free, total, 0)


class Router:
    """GetServerInfo's stand-in: answers `workers` after `delay_s`, or raises when `down`."""

    def __init__(self, workers: list[WorkerStatus], delay_s: float = 0.0) -> None:
        self.workers, self.delay_s, self.down, self.calls = workers, delay_s, False, 0

    async def __call__(self) -> tuple[str, ServerInfo]:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.down:
            raise ConnectionError("router unreachable")
        return "smol", ServerInfo("0", "aggregated", "least_load", list(self.workers))


def samples(body: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {
        f.name: [(dict(s.labels), s.value) for s in f.samples]
        for f in text_string_to_metric_families(body.decode())
        if f.name in (*GIE, "vllm:lora_requests_info")
    }


def test_fleet_sample_first_then_each_worker_with_gie_names():
    router = Router([worker("w0", 3, 2, 60, 100), worker("w1", 1, 0, 90, 100)])
    got = samples(asyncio.run(FleetGauges(router).render()))
    m = {"model_name": "smol"}
    assert got["vllm:num_requests_running"] == [
        (m, 4.0), ({**m, "worker": "w0"}, 3.0), ({**m, "worker": "w1"}, 1.0)
    ]  # fmt: skip
    assert got["vllm:num_requests_waiting"] == [
        (m, 2.0), ({**m, "worker": "w0"}, 2.0), ({**m, "worker": "w1"}, 0.0)
    ]  # fmt: skip
    [(_, fleet), (_, w0), (_, w1)] = got["vllm:kv_cache_usage_perc"]
    assert (fleet, w0, w1) == (0.25, 0.4, 0.1)  # 50 of 200 blocks used; 40 of 100; 10 of 100
    [(lora, stamp)] = got["vllm:lora_requests_info"]
    assert lora == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(stamp - time.time()) < 60


def test_same_named_gauges_of_this_process_are_replaced_not_repeated():
    NUM_REQUESTS_RUNNING.labels("other-model").set(7)  # a router in this process, say
    body = asyncio.run(FleetGauges(Router([worker("w0", 1, 0, 10, 10)])).render())
    assert body.count(b"# TYPE vllm:num_requests_running gauge") == 1
    assert samples(body)["vllm:num_requests_running"][0] == ({"model_name": "smol"}, 1.0)
    assert b"python_info" in body  # the rest of the registry is still there


def test_scrapes_within_the_ttl_share_one_router_call():
    router = Router([worker("w0", 0, 0, 10, 10)])
    gauges = FleetGauges(router, ttl_s=60.0)

    async def scrape_many() -> None:
        await asyncio.gather(*(gauges.render() for _ in range(5)))
        await gauges.render()

    asyncio.run(scrape_many())
    assert router.calls == 1


def test_a_slow_router_bounds_the_scrape_and_a_dead_one_drops_the_gauges():
    router = Router([worker("w0", 2, 0, 10, 10)])
    gauges = FleetGauges(router, ttl_s=0.0, timeout_s=0.2, stale_s=30.0)

    async def scenario() -> tuple[dict, float, dict, dict]:
        fresh = samples(await gauges.render())
        router.delay_s = 5.0  # slower than the scrape waits: the last values, in time
        start = time.monotonic()
        slow = samples(await gauges.render())
        waited = time.monotonic() - start
        router.delay_s, router.down = 0.0, True
        gauges.stale_s = 0.0  # and once they are too old: no gauges rather than stale ones
        await asyncio.sleep(0.01)
        errors = LOAD_ERRORS._value.get()
        dead = samples(await gauges.render())
        assert LOAD_ERRORS._value.get() > errors
        return fresh, waited, slow, dead

    fresh, waited, slow, dead = asyncio.run(scenario())
    assert fresh["vllm:num_requests_running"][0][1] == 2.0
    assert waited < 1.0 and slow["vllm:num_requests_running"] == fresh["vllm:num_requests_running"]
    assert not any(name in dead for name in GIE)


def test_another_threads_scrape_runs_the_fetch_on_the_bound_loop():
    router = Router([worker("w0", 1, 1, 5, 10)])
    gauges = FleetGauges(router)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        gauges.bind(loop)
        body = prometheus_client.generate_latest(gauges)  # as the metrics port's server does
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    assert samples(body)["vllm:kv_cache_usage_perc"][0] == ({"model_name": "smol"}, 0.5)
    assert router.calls == 1
