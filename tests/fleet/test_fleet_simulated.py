"""A fleet of simulated workers (real router, tokenizer, kvstore, gateway and engines; a
step-time model in place of the forward pass) under concurrent load: every gRPC stream and
every OpenAI streaming chat completes, and the workers end idle with every block free."""

from __future__ import annotations

import asyncio
import urllib.request

import openai
import pytest
from fleet_helpers import wait_all_blocks_free
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import sim_checkpoint

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import AsyncGenerationClient

CONCURRENCY = 64
MAX_TOKENS = 16
SIMULATED = {"simulate": True, "sim_step_ms": 2.0, "sim_decode_ms_per_seq": 0.02}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    spec = FleetSpec(
        port=0,
        workers=2,
        model=sim_checkpoint(),
        engine=SIMULATED,
        gateway=True,
        http_port=0,
        log_dir=str(tmp_path_factory.mktemp("logs")),
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


def test_concurrent_grpc_streams_all_complete(fleet):
    async def one(client: AsyncGenerationClient, i: int) -> tuple[int, str | None, int]:
        stream = client.stream(
            token_ids=[100 + i % 50] * (20 + i), max_tokens=MAX_TOKENS, ignore_eos=True
        )
        tokens, finish = 0, None
        async for delta in stream:
            tokens += len(delta.token_ids)
            finish = delta.finish_reason or finish
        return tokens, finish, stream.usage.completion_tokens

    async def run() -> list[tuple[int, str | None, int]]:
        async with AsyncGenerationClient(fleet.endpoint) as client:
            return await asyncio.gather(*(one(client, i) for i in range(CONCURRENCY)))

    assert asyncio.run(run()) == [(MAX_TOKENS, "length", MAX_TOKENS)] * CONCURRENCY
    stats = wait_all_blocks_free(fleet)
    assert all(s.load.num_free_blocks == s.load.num_total_blocks for s in stats)


def test_concurrent_openai_streaming_chats_all_complete(fleet):
    client = openai.AsyncOpenAI(base_url=f"{fleet.http_url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run() -> list[tuple[str, str | None]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(CONCURRENCY)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert [finish for _, finish in results] == ["length"] * CONCURRENCY
    assert all(text for text, _ in results)
    wait_all_blocks_free(fleet)


def _lease_outcomes(fleet: Fleet) -> dict[str, float]:
    with urllib.request.urlopen(fleet.child("router").metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llmfleet:lease_outcomes_total"
    }


def test_a_full_decode_worker_slows_admission_down_instead_of_failing(tmp_path):
    """Disaggregated, one prefill and one decode worker whose KV holds a few prompts: 32
    concurrent long prompts all complete; requests wait for the decode worker's capacity and
    no lease expires."""
    spec = FleetSpec(
        port=0,
        disaggregated=True,
        model=sim_checkpoint(),
        engine={**SIMULATED, "sim_decode_ms_per_seq": 1.0, "block_size": 16},
        extra_args={
            "worker": ["--num-kv-blocks", "64", "--lease-ttl-ms", "5000"],
            "router": ["--short-prompt-threshold", "8", "--max-prefills-per-worker", "4"],
        },
        log_dir=str(tmp_path),
        startup_timeout_s=240,
    )

    async def one(client: AsyncGenerationClient, i: int) -> int:
        # 128 prompt tokens (8 blocks) + 16 out: 9 blocks each, so 64 blocks hold 7 at once.
        result = await client.generate(
            token_ids=[200 + i] * 128, max_tokens=MAX_TOKENS, ignore_eos=True
        )
        return result.usage.completion_tokens

    async def run(endpoint: str) -> list[int]:
        async with AsyncGenerationClient(endpoint) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    with Fleet(spec) as fleet:
        assert asyncio.run(run(fleet.endpoint)) == [MAX_TOKENS] * 32
        outcomes = _lease_outcomes(fleet)
        assert outcomes["reserve_waited"] > 0  # the decode worker did fill up
        assert outcomes["expired"] == outcomes["failed"] == outcomes["reserve_failed"] == 0
        assert outcomes["committed"] == 32
        wait_all_blocks_free(fleet)
