"""GetWorkerStats reports a worker's speculative decoding: its method, k and drafting threshold,
and the engine's drafted / accepted / emitted token counts since start; nothing for a worker
that does not speculate."""

from __future__ import annotations

import pytest
import torch
import zmq.asyncio
from worker_helpers import (
    Replies,
    add_request_pb,
    prompt,
    reference_tokens,
    run,
    start_worker,
    stats,
    stub,
)

from llmfleet.models.loader import load_model
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative import SpeculativeConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, disable_batch_size=8)


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)


async def stub_add(w, ids: list[int], replies: Replies) -> None:
    await stub(w).AddRequest(add_request_pb("r1", ids, GREEDY, replies.endpoint))


def repetitive(loaded) -> list[int]:
    phrase = prompt(loaded, 5, seed=3)
    return phrase * 6 + phrase[:2]  # prompt lookup finds what followed each suffix


def test_a_speculating_worker_reports_its_settings_and_draft_counts(loaded):
    ids = repetitive(loaded)
    ref = reference_tokens(loaded, ids, GREEDY)[0]

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded, engine_kw={"speculative": NGRAM})
        replies = Replies(ctx)
        try:
            before = await stats(w)
            assert before.HasField("spec_decode")
            spec = before.spec_decode
            assert (spec.method, spec.num_speculative_tokens, spec.disable_batch_size) == (
                "ngram",
                4,
                8,
            )
            assert spec.num_steps == spec.num_draft_tokens == spec.num_emitted_tokens == 0
            await stub_add(w, ids, replies)
            [c] = await replies.until_finished("r1")
            assert c.tokens == ref  # drafts never change greedy output
            return (await stats(w)).spec_decode
        finally:
            replies.close()
            await w.stop(grace_s=0)
            ctx.term()

    spec = run(body())
    assert spec.num_draft_tokens > 0 and spec.num_steps > 0
    assert 0 <= spec.num_accepted_tokens <= spec.num_draft_tokens
    # Each drafted step emits its accepted drafts plus one token of the target's.
    assert spec.num_emitted_tokens > spec.num_accepted_tokens
    assert spec.num_emitted_tokens <= len(ref)


def test_a_worker_without_speculation_reports_none(loaded):
    ids = repetitive(loaded)

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded)
        replies = Replies(ctx)
        try:
            await stub_add(w, ids, replies)
            await replies.until_finished("r1")
            return await stats(w)
        finally:
            replies.close()
            await w.stop(grace_s=0)
            ctx.term()

    resp = run(body())
    assert not resp.HasField("spec_decode")
    assert resp.spec_decode.num_draft_tokens == 0 and resp.spec_decode.method == ""
