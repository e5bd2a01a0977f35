"""Routing, KV-event resync, liveness, router restart and migration, with fake workers."""

from __future__ import annotations

import grpc
import pytest
from fakes import prompt_hashes
from harness import Fleet, eventually, letters, read_rest, run, sampling, tokens_of
from prometheus_client import REGISTRY

from llmfleet.v1 import generation_pb2

PROMPT = "the quick brown fox jumps over"  # 30 bytes: 7 full blocks of 4
ERRORS = "llmfleet:routing_ttft_prediction_error_seconds_count"


def _owner(*workers) -> list[str]:
    return [w.worker_id for w in workers for _ in w.requests("AddRequest")]


def test_round_robin_alternates():
    async def body():
        async with Fleet(routing_policy="round_robin") as fleet:
            a = await fleet.add_worker("a")
            b = await fleet.add_worker("b")
            for _ in range(4):
                await fleet.generate(text="hi", sampling=sampling(max_tokens=1))
            assert len(a.requests("AddRequest")) == 2 and len(b.requests("AddRequest")) == 2

    run(body())


def test_prefix_aware_follows_kv_events_and_falls_back_to_load():
    async def body():
        async with Fleet(routing_policy="prefix_aware", prefix_load_threshold=2) as fleet:
            a = await fleet.add_worker("a")
            b = await fleet.add_worker("b")
            hashes = prompt_hashes(list(PROMPT.encode()))
            await b.publish(hashes)
            await eventually(lambda: fleet.router.kv.index.matched_prefix("b", hashes) == 7)
            for _ in range(2):
                await fleet.generate(text=PROMPT, sampling=sampling(max_tokens=1))
            assert _owner(a, b) == ["b", "b"]
            b.load.num_running = 3  # 3 more than a: beyond the threshold of 2
            await eventually(lambda: fleet.router.registry.get("b").load.num_running == 3)
            await fleet.generate(text=PROMPT, sampling=sampling(max_tokens=1))
            assert len(a.requests("AddRequest")) == 1

    run(body())


def test_kv_event_gap_fetches_snapshot_and_routes_correctly():
    async def body():
        async with Fleet(routing_policy="prefix_aware") as fleet:
            a = await fleet.add_worker("a")
            b = await fleet.add_worker("b")
            hashes = prompt_hashes(list(PROMPT.encode()))
            snapshots = b.num_snapshots
            await b.publish(hashes[:2])
            await b.publish(hashes[2:], lost=True)  # seq 2 never arrives
            await b.publish([bytes(32)])  # seq 3: the gap shows
            await eventually(lambda: b.num_snapshots > snapshots, what="snapshot fetched")
            await eventually(lambda: fleet.router.kv.index.matched_prefix("b", hashes) == 7)
            await fleet.generate(text=PROMPT, sampling=sampling(max_tokens=1))
            assert _owner(a, b) == ["b"]

    run(body())


def test_restarted_scheduler_resyncs_from_snapshots():
    async def body():
        async with Fleet(routing_policy="prefix_aware") as fleet:
            a = await fleet.add_worker("a")
            b = await fleet.add_worker("b")
            hashes = prompt_hashes(list(PROMPT.encode()))
            await b.publish(hashes)
            port = fleet.server.service.port
            await fleet.stop_router()
            await fleet.start_router(port)
            await eventually(lambda: len(fleet.router.registry.live()) == 2, what="re-registered")
            await eventually(lambda: fleet.router.kv.index.matched_prefix("b", hashes) == 7)
            assert a.registrations >= 1 and b.registrations >= 1
            await fleet.generate(text=PROMPT, sampling=sampling(max_tokens=1))
            assert _owner(a, b) == ["b"]

    run(body())


def test_silent_worker_gets_no_traffic_and_late_joiner_does():
    async def body():
        async with Fleet(routing_policy="round_robin") as fleet:
            a = await fleet.add_worker("a")
            b = await fleet.add_worker("b")
            a.stop_heartbeats()
            await eventually(lambda: not fleet.router.registry.is_live("a"), what="a expired")
            for _ in range(3):
                await fleet.generate(text="hi", sampling=sampling(max_tokens=1))
            assert len(a.requests("AddRequest")) == 0 and len(b.requests("AddRequest")) == 3
            c = await fleet.add_worker("c")
            for _ in range(2):
                await fleet.generate(text="hi", sampling=sampling(max_tokens=1))
            assert len(c.requests("AddRequest")) == 1 and len(b.requests("AddRequest")) == 4

    run(body())


def test_migration_continues_the_stream_without_loss_or_repeat():
    async def body():
        async with Fleet(routing_policy="round_robin", max_retries=1) as fleet:
            a = await fleet.add_worker("a", step_s=0.03)
            b = await fleet.add_worker("b", step_s=0.005)
            prompt = list(b"migrate")
            call = fleet.stub.Generate(
                generation_pb2.GenerateRequest(
                    request_id="m1",
                    tokens=generation_pb2.TokenPrompt(token_ids=prompt),
                    sampling=sampling(max_tokens=12),
                )
            )
            head = [await call.read() for _ in range(3)]
            assert a.requests("AddRequest")
            await a.kill()
            rest = await read_rest(call)
            out = head + rest
            got = bytes(tokens_of(out, 0)).decode()
            assert got == letters(len(prompt), 12)
            assert "".join(d.text for r in out for d in r.deltas) == got
            resubmitted = b.requests("AddRequest")[0]
            streamed = list(resubmitted.prompt_token_ids)[len(prompt) :]
            assert list(resubmitted.prompt_token_ids)[: len(prompt)] == prompt
            assert len(streamed) >= 3 and resubmitted.sampling.max_tokens == 12 - len(streamed)
            assert out[-1].usage.completion_tokens == 12

    run(body())


def test_migration_gives_up_after_max_retries():
    async def body():
        async with Fleet(max_retries=1) as fleet:
            a = await fleet.add_worker("a", step_s=0.03)
            call = fleet.stub.Generate(
                generation_pb2.GenerateRequest(text="x", sampling=sampling(max_tokens=50))
            )
            await call.read()
            await a.kill()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_rest(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    run(body())


def test_predicted_ttft_weighs_reported_queues_and_step_times_against_the_prefix():
    """The scorer reads each worker's reported queue and measured step times: the prefix
    holder wins while its queue is short; once it reports a long prompt queue the idle worker
    wins; and a request routed but not yet answered counts in its worker's queue at once."""

    async def body():
        async with Fleet(routing_policy="predicted_ttft") as fleet:
            a = await fleet.add_worker("a")
            b = await fleet.add_worker("b")
            for w in (a, b):
                w.load.step_seconds, w.load.prefill_seconds_per_token = 0.02, 1e-3
            hashes = prompt_hashes(list(PROMPT.encode()))
            await b.publish(hashes)
            await eventually(lambda: fleet.router.kv.index.matched_prefix("b", hashes) == 7)
            await eventually(lambda: fleet.router.registry.get("a").load.step_seconds == 0.02)
            errors = REGISTRY.get_sample_value(ERRORS, {"policy": "predicted_ttft"}) or 0.0
            await fleet.generate(text=PROMPT, sampling=sampling(max_tokens=1))
            assert _owner(a, b) == ["b"]
            b.load.num_queued_prompt_tokens = 5000  # 5 s of prompts ahead on b
            await eventually(
                lambda: fleet.router.registry.get("b").load.num_queued_prompt_tokens == 5000
            )
            await fleet.generate(text=PROMPT, sampling=sampling(max_tokens=1))
            assert _owner(a, b) == ["a", "b"]
            placement = fleet.router.placement
            assert placement.routed.prefilling == {}  # answered: nothing counted as queued
            # each first token measured the prediction's error
            assert REGISTRY.get_sample_value(ERRORS, {"policy": "predicted_ttft"}) == errors + 2

    run(body())


def test_a_session_returns_to_its_worker_when_the_prediction_is_a_tie():
    """Session affinity is a hint: equal predictions go to the session's last worker though it
    is busier; a request without a session, or a new session, goes to the least loaded."""

    async def body():
        async with Fleet(routing_policy="predicted_ttft") as fleet:
            a = await fleet.add_worker("a")
            b = await fleet.add_worker("b")
            await fleet.generate(text="hi", sampling=sampling(max_tokens=1), session_id="s")
            assert _owner(a, b) == ["a"]  # a tie, both idle: the lower id
            a.load.num_running = 2
            await eventually(lambda: fleet.router.registry.get("a").load.num_running == 2)
            await fleet.generate(text="ho", sampling=sampling(max_tokens=1), session_id="s")
            assert _owner(a, b) == ["a", "a"]  # its session's worker, though busier
            await fleet.generate(text="hu", sampling=sampling(max_tokens=1))
            await fleet.generate(text="he", sampling=sampling(max_tokens=1), session_id="t")
            assert _owner(a, b) == ["a", "a", "b", "b"]  # the least loaded
            # ...but not against the prediction: a long queue on a sends the session away.
            a.load.num_queued_prompt_tokens = 100_000
            await eventually(
                lambda: fleet.router.registry.get("a").load.num_queued_prompt_tokens == 100_000
            )
            await fleet.generate(text="ha", sampling=sampling(max_tokens=1), session_id="s")
            assert _owner(a, b) == ["a", "a", "b", "b", "b"]

    run(body())
