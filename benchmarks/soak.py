"""Soak a local fleet at full load and check that nothing leaks (`make soak`).

    python benchmarks/soak.py [--duration-s 600] [--workers 2] [--concurrency 48] [--real]

Starts a fleet as `llmfleet up` does (kvstore, tokenizer, router, workers; simulated workers by
default, the bundled model with `--real`), warms it up, then keeps `--concurrency` Generate
streams in flight for `--duration-s` (more than the workers run at once: requests queue), and
cancels `--cancel-fraction` of them (10%) mid-stream. Before and after it prints, per fleet
process, the KV blocks free (workers), RSS and open file descriptors, and the failed requests.

Exit status 1 when a request failed (an error, or a stream that ended short without being
cancelled), a worker was dropped or restarted, a worker's KV blocks are not all free again, a
process's open fds are above its baseline, or its RSS grew by more than `--max-rss-growth`
(10%); 0 otherwise. The baseline is taken after the warm-up, so first-request allocations do
not count as growth.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import AsyncGenerationClient, ClientError, GenerationClient
from llmfleet.v1 import worker_pb2, worker_pb2_grpc

SIMULATED = {"simulate": True, "sim_step_ms": 10.0, "sim_decode_ms_per_seq": 0.05}
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Tally:
    """What the clients saw."""

    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # status name (or "short") -> count
    tokens: int = 0

    def fail(self, why: str) -> None:
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1


@dataclass(frozen=True)
class ProcState:
    rss_bytes: int
    num_fds: int
    free_blocks: int | None = None  # workers
    total_blocks: int | None = None


def proc_state(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of a live process, from /proc."""
    with open(f"/proc/{pid}/statm") as f:
        rss_pages = int(f.read().split()[1])
    return rss_pages * _PAGE, len(os.listdir(f"/proc/{pid}/fd"))


def worker_blocks(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as ch:
        stats = worker_pb2_grpc.WorkerStub(ch).GetWorkerStats(
            worker_pb2.GetWorkerStatsRequest(), timeout=10
        )
    return stats.load.num_free_blocks, stats.load.num_total_blocks


def snapshot(fleet: Fleet) -> dict[str, ProcState]:
    """Every fleet process's state, by child name."""
    out = {}
    for c in fleet.children:
        assert c.proc is not None
        rss, fds = proc_state(c.proc.pid)
        free = total = None
        if c.kind == "worker":
            free, total = worker_blocks(c.address)
        out[c.name] = ProcState(rss, fds, free, total)
    return out


def wait_idle(fleet: Fleet, timeout_s: float = 60.0) -> None:
    """Until every worker has all its KV blocks free (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(f == t for f, t in (worker_blocks(a) for a in fleet.worker_addresses)):
            return
        time.sleep(0.2)


async def drive(
    endpoint: str,
    duration_s: float,
    concurrency: int,
    max_tokens: int,
    cancel_fraction: float,
    seed: int = 0,
) -> Tally:
    """Keep `concurrency` streams in flight for `duration_s`; cancel `cancel_fraction` of them
    after a random number of tokens."""
    rng = random.Random(seed)
    tally = Tally()
    deadline = time.monotonic() + duration_s

    async def one(client: AsyncGenerationClient) -> None:
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randrange(8, 96))]
        cancel_at = rng.randrange(1, max_tokens) if rng.random() < cancel_fraction else None
        stream = client.stream(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
        tokens, finish = 0, None
        try:
            async for delta in stream:
                tokens += len(delta.token_ids)
                finish = delta.finish_reason or finish
                if cancel_at is not None and tokens >= cancel_at:
                    stream.cancel()
                    tally.cancelled += 1
                    return
        except ClientError as exc:
            tally.fail(exc.code_name)
            return
        finally:
            tally.tokens += tokens
        if tokens == max_tokens and finish == "length":
            tally.completed += 1
        else:
            tally.fail("short")

    async def lane(client: AsyncGenerationClient) -> None:
        while time.monotonic() < deadline:
            await one(client)

    async with AsyncGenerationClient(endpoint) as client:
        await asyncio.gather(*(lane(client) for _ in range(concurrency)))
    return tally


def problems(
    before: dict[str, ProcState], after: dict[str, ProcState], max_rss_growth: float
) -> list[str]:
    found = []
    for name, b in before.items():
        a = after[name]
        if a.free_blocks != a.total_blocks:
            found.append(f"{name}: {a.free_blocks}/{a.total_blocks} KV blocks free after")
        if a.num_fds > b.num_fds:
            found.append(f"{name}: open fds {b.num_fds} -> {a.num_fds}")
        if a.rss_bytes > b.rss_bytes * (1 + max_rss_growth):
            growth = a.rss_bytes / b.rss_bytes - 1
            found.append(f"{name}: RSS grew {growth:.0%} (> {max_rss_growth:.0%})")
    return found


def table(before: dict[str, ProcState], after: dict[str, ProcState]) -> str:
    rows = [f"{'process':<12} {'RSS MiB':>17} {'open fds':>11} {'KV blocks free':>23}"]
    for name, b in before.items():
        a = after[name]
        kv = f"{b.free_blocks}/{b.total_blocks} -> {a.free_blocks}" if b.total_blocks else "-"
        rss = f"{b.rss_bytes / 2**20:.1f} -> {a.rss_bytes / 2**20:.1f}"
        rows.append(f"{name:<12} {rss:>17} {f'{b.num_fds} -> {a.num_fds}':>11} {kv:>23}")
    return "\n".join(rows)


@dataclass(frozen=True)
class SoakResult:
    tally: Tally
    before: dict[str, ProcState]
    after: dict[str, ProcState]
    problems: list[str]
    workers_seen: int  # workers registered with the router at the end


def soak(fleet: Fleet, args: Any, out: Any = None) -> SoakResult:
    """Warm up, take the baseline, drive, wait until idle, compare; the report goes to `out`
    (stdout)."""
    out = out or sys.stdout
    warm = asyncio.run(drive(fleet.endpoint, args.warmup_s, args.concurrency, args.max_tokens, 0))
    wait_idle(fleet)
    before = snapshot(fleet)
    print(f"warm-up: {warm.completed} requests, {warm.failed} failed", file=out)
    print(f"driving {args.concurrency} streams for {args.duration_s:g} s ...", file=out, flush=True)
    start = time.monotonic()
    tally = asyncio.run(
        drive(
            fleet.endpoint,
            args.duration_s,
            args.concurrency,
            args.max_tokens,
            args.cancel_fraction,
            seed=1,
        )
    )
    elapsed = time.monotonic() - start
    wait_idle(fleet)
    after = snapshot(fleet)
    found = problems(before, after, args.max_rss_growth)
    with GenerationClient(fleet.endpoint) as client:
        workers_seen = len(client.server_info().workers)
    restarted = {c.name: fleet.num_restarts(c.name) for c in fleet.children}
    found += [f"{name} was restarted {n} times" for name, n in restarted.items() if n]
    if workers_seen != len(fleet.workers):
        found.append(f"{workers_seen} of {len(fleet.workers)} workers registered at the end")
    if tally.failed or warm.failed:
        found.append(f"{tally.failed + warm.failed} requests failed: {tally.errors}")
    print(table(before, after), file=out)
    print(
        f"requests: {tally.completed} completed, {tally.cancelled} cancelled mid-stream, "
        f"{tally.failed} failed {tally.errors or ''}; {tally.tokens / elapsed:.0f} tokens/s",
        file=out,
    )
    return SoakResult(tally, before, after, found, workers_seen)


def kvstore_ram_bytes(args: Any) -> int:
    """The kvstore's budget: `--kvstore-ram-bytes`, else a few dozen blocks of the model (512
    KiB of ~150-byte simulated blocks; 16 MiB of the bundled model's 720 KiB blocks)."""
    if args.kvstore_ram_bytes is not None:
        return args.kvstore_ram_bytes
    return 16 << 20 if args.real else 1 << 19


def fleet_spec(args: Any, log_dir: str | None = None) -> FleetSpec:
    engine: dict[str, Any] = {} if args.real else dict(SIMULATED)
    engine["max_num_seqs"] = args.max_num_seqs
    return FleetSpec(
        port=0,
        workers=args.workers,
        engine=engine,
        kvstore=True,
        # A store budget the warm-up fills (simulated blocks are ~150 bytes, so per-entry overhead
        # dominates): growth after it is a leak, not the cache filling.
        extra_args={"kvstore": ["--ram-bytes", str(kvstore_ram_bytes(args))]},
        gateway=False,
        log_dir=log_dir,
        startup_timeout_s=300.0,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--warmup-s", type=float, default=60.0, help="fills the caches first")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=48, help="streams in flight")
    p.add_argument("--max-num-seqs", type=int, default=16, help="per worker: the rest queue")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--real", action="store_true", help="the bundled model, not simulated workers")
    p.add_argument("--kvstore-ram-bytes", type=int, default=None, help="the kvstore RAM budget")
    p.add_argument("--log-dir", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with Fleet(fleet_spec(args, args.log_dir)) as fleet:
        print(f"fleet up (logs in {fleet.log_dir})", flush=True)
        result = soak(fleet, args)
    for p in result.problems:
        print(f"FAIL: {p}")
    print("soak: OK" if not result.problems else "soak: FAILED")
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
