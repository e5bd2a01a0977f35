"""Disaggregated flow with fake prefill and decode workers: the KV lease handoff."""

from __future__ import annotations

import asyncio

from harness import Fleet, eventually, letters, run, sampling, tokens_of

from llmfleet.v1 import generation_pb2

LONG = "a prompt long enough for a prefill worker"  # 41 bytes >= threshold 16


def _fleet(**kw):
    return Fleet(mode="disaggregated", short_prompt_threshold=16, routing_policy="least_load", **kw)


def test_reserve_prefill_start_decode_and_first_token_once():
    async def body():
        async with _fleet() as fleet:
            d = await fleet.add_worker("d", "decode")
            p = await fleet.add_worker("p", "prefill")
            out, text = await fleet.generate(text=LONG, sampling=sampling(max_tokens=6))
            assert text == letters(len(LONG), 6)  # first token (from p) exactly once
            assert out[0].deltas[0].token_ids == [ord(letters(len(LONG), 1))]
            assert d.names() == ["ReserveKV", "StartDecode"]
            assert p.names() == ["Prefill"]
            lease = p.requests("Prefill")[0].lease
            start = d.requests("StartDecode")[0]
            assert start.lease_id == lease.lease_id and start.epoch == lease.epoch
            assert start.first_token_id == tokens_of(out, 0)[0]
            assert out[-1].usage.completion_tokens == 6

    run(body())


def test_prefill_failure_releases_lease_and_retries_on_another_prefill_worker():
    async def body():
        async with _fleet(max_retries=1) as fleet:
            d = await fleet.add_worker("d", "decode")
            p1 = await fleet.add_worker("p1", "prefill", prefill_failures=1)
            p2 = await fleet.add_worker("p2", "prefill")
            _, text = await fleet.generate(text=LONG, sampling=sampling(max_tokens=5))
            assert text == letters(len(LONG), 5)
            assert d.names() == ["ReserveKV", "ReleaseKV", "ReserveKV", "StartDecode"]
            first_lease = p1.requests("Prefill")[0].lease
            assert d.requests("ReleaseKV")[0].lease_id == first_lease.lease_id
            assert p2.names() == ["Prefill"]

    run(body())


def test_short_prompts_and_n2_go_straight_to_decode():
    async def body():
        async with _fleet() as fleet:
            d = await fleet.add_worker("d", "decode")
            p = await fleet.add_worker("p", "prefill")
            _, text = await fleet.generate(text="short", sampling=sampling(max_tokens=3))
            assert text == letters(5, 3)
            out, _ = await fleet.generate(text=LONG, sampling=sampling(n=2, max_tokens=3))
            assert out[-1].usage.completion_tokens == 6
            assert d.names() == ["AddRequest", "AddRequest"] and p.names() == []

    run(body())


def test_cancel_during_decode_cancels_on_decode_worker():
    async def body():
        async with _fleet() as fleet:
            d = await fleet.add_worker("d", "decode", step_s=0.02)
            await fleet.add_worker("p", "prefill")
            call = fleet.stub.Generate(
                generation_pb2.GenerateRequest(
                    request_id="dc", text=LONG, sampling=sampling(max_tokens=100)
                )
            )
            await call.read()
            await call.read()
            call.cancel()
            await eventually(lambda: d.requests("Cancel"), what="Cancel on decode worker")
            assert d.requests("Cancel")[0].request_id == "dc"

    run(body())


def test_predicted_ttft_sends_the_decode_to_the_worker_whose_step_stays_short():
    """With the predicting policy the decode worker is scored too: the one whose measured
    per-sequence cost makes its next step shorter wins over a less loaded but slower one."""

    async def body():
        async with Fleet(
            mode="disaggregated", short_prompt_threshold=16, routing_policy="predicted_ttft"
        ) as fleet:
            slow = await fleet.add_worker("d-slow", "decode")
            fast = await fleet.add_worker("d-fast", "decode")
            await fleet.add_worker("p", "prefill")
            slow.load.num_running, slow.load.step_seconds = 0, 0.05
            slow.load.step_seconds_per_seq = 0.01
            fast.load.num_running, fast.load.step_seconds = 3, 0.01
            fast.load.step_seconds_per_seq = 0.001
            await eventually(lambda: fleet.router.registry.get("d-fast").load.num_running == 3)
            await eventually(lambda: fleet.router.registry.get("d-slow").load.step_seconds == 0.05)
            _, text = await fleet.generate(text=LONG, sampling=sampling(max_tokens=3))
            assert text == letters(len(LONG), 3)
            assert fast.names() == ["ReserveKV", "StartDecode"] and slow.names() == []

    run(body())


def test_a_prefill_in_flight_counts_in_its_workers_queue_for_routing():
    async def body():
        async with _fleet() as fleet:
            await fleet.add_worker("d", "decode")
            p = await fleet.add_worker("p", "prefill")
            p.prefill_gate = asyncio.Event()
            call = asyncio.create_task(fleet.generate(text=LONG, sampling=sampling(max_tokens=2)))
            await eventually(lambda: p.names() == ["Prefill"])
            routed = fleet.router.placement.routed
            assert routed.prefilling == {"p": (len(LONG), 1)}  # tokens, requests
            assert routed.incoming == {"d": len(LONG)}  # the KV leased on d, to be pushed
            p.prefill_gate.set()
            _, text = await call
            assert text == letters(len(LONG), 2)
            assert routed.prefilling == {} and routed.incoming == {}

    run(body())
