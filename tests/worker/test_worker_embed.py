"""A worker's Embed RPC, in process: the engine's pooled vectors come back in order, roles and
inputs are checked, no KV is left behind, and a failed forward pass answers UNAVAILABLE."""

from __future__ import annotations

import grpc
import pytest
import torch
from worker_helpers import engine_config, prompt, run, start_worker, stub

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_model
from llmfleet.shared.core.pooling_params import PoolingParams
from llmfleet.shared.wire.embedding import token_inputs
from llmfleet.v1 import embedding_pb2, worker_pb2


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)


def reference(loaded, inputs: list[list[int]], params: PoolingParams) -> list[list[float]]:
    engine = LLMEngine(engine_config(), loaded)
    out: dict[str, list[float]] = {}
    for i, ids in enumerate(inputs):
        engine.pooler.add(
            f"r{i}", ids, params, lambda o: out.__setitem__(o.request_id, o.embedding)
        )
    while engine.has_unfinished():
        engine.step()
    return [out[f"r{i}"] for i in range(len(inputs))]


def test_embed_returns_the_pooled_vectors_in_order_and_frees_the_kv(loaded):
    inputs = [prompt(loaded, n, seed=n) for n in (3, 70, 9)]

    async def body():
        worker = await start_worker(loaded, role="prefill")
        try:
            s = stub(worker)
            req = embedding_pb2.EmbedRequest(
                request_id="e1", inputs=token_inputs(inputs), pooling=embedding_pb2.POOLING_MEAN
            )
            resp = await s.Embed(req)
            stats = await s.GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
            return resp, stats.load
        finally:
            await worker.stop(grace_s=0)

    resp, load = run(body())
    assert resp.request_id == "e1" and resp.num_prompt_tokens == 82
    assert [e.num_prompt_tokens for e in resp.embeddings] == [3, 70, 9]
    ref = reference(loaded, inputs, PoolingParams(pooling="mean"))
    for got, want in zip(resp.embeddings, ref, strict=True):
        torch.testing.assert_close(torch.tensor(list(got.values)), torch.tensor(want))
    assert load.num_free_blocks == load.num_total_blocks and load.num_running == 0


def test_roles_inputs_and_a_failed_forward_pass(loaded):
    async def body():
        decode = await start_worker(loaded, role="decode")
        failing = await start_worker(loaded, role="prefill", fault_inject_step=1)
        codes = []
        try:
            bad = [
                (decode, embedding_pb2.EmbedRequest(inputs=token_inputs([[1, 2]]))),
                (failing, embedding_pb2.EmbedRequest(inputs=[embedding_pb2.EmbedInput(text="x")])),
                (failing, embedding_pb2.EmbedRequest(inputs=token_inputs([[1], [10**6]]))),
                (failing, embedding_pb2.EmbedRequest(inputs=token_inputs([[1]]), dimensions=4)),
                (failing, embedding_pb2.EmbedRequest(inputs=token_inputs([[1, 2]]))),
            ]
            for worker, req in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub(worker).Embed(req)
                codes.append((err.value.code(), err.value.details().split(":")[0]))
        finally:
            await decode.stop(grace_s=0)
            await failing.stop(grace_s=0)
        return codes

    invalid, unavailable = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE
    codes = run(body())
    assert codes[0][0] is grpc.StatusCode.FAILED_PRECONDITION
    assert codes[1:4] == [(invalid, "inputs[0]"), (invalid, "inputs[1]"), (invalid, "dimensions")]
    assert codes[4][0] is unavailable  # the forward pass failed: the router tries elsewhere
