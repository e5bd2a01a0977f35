"""Images through an in-process worker: AddRequest carries ImageRefs, the worker fetches the
pixels its encoder cache lacks from a media store (ZMQ), and errors have their codes."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch
import zmq
import zmq.asyncio
from mm_reference import checkpoint, engine_inputs, hf_greedy, image, processed, prompt_text
from prometheus_client import REGISTRY
from worker_helpers import Replies, add_request_pb, run, start_worker, stub

from llmfleet.models.loader import load_model
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.convert import images_to_pb
from llmfleet.shared.wire.media import MediaServer, MediaStore
from llmfleet.v1 import worker_pb2

STEPS = 5
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava():
    ckpt = checkpoint("llava")
    proc = processed("llava", ckpt, prompt_text("llava", 1), [image(7, (28, 28))])
    loaded = load_model(ckpt, dtype=torch.float32, progress=False)
    return loaded, proc, hf_greedy(ckpt, proc, STEPS)


def request(rid, proc, endpoint, reply) -> worker_pb2.AddRequestRequest:
    ids, images, _ = engine_inputs("llava", proc)
    images = tuple(dataclasses.replace(im, media_endpoint=endpoint) for im in images)
    pb = add_request_pb(rid, ids, GREEDY, reply)
    pb.images.extend(images_to_pb(images))
    return pb


def counter(name: str, model: str) -> float:
    return REGISTRY.get_sample_value(name + "_total", {"model_name": model}) or 0.0


def test_pixels_come_from_the_media_store_once(llava):
    loaded, proc, want = llava
    model = loaded.spec.model_id
    _, images, pixels = engine_inputs("llava", proc)

    async def body():
        ctx = zmq.asyncio.Context()
        store = MediaStore(capacity_bytes=1 << 20)
        for h, p in pixels.items():
            store.put(h, p)
        sock = ctx.socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        server = MediaServer(sock, store)
        serving = asyncio.create_task(server.run())
        w = await start_worker(loaded, engine_kw={"max_num_batched_tokens": 64})
        replies = Replies(ctx)
        misses0 = counter("llmfleet:encoder_cache_misses", model)
        hits0 = counter("llmfleet:encoder_cache_hits", model)
        try:
            s = stub(w)
            await s.AddRequest(request("a", proc, endpoint, replies.endpoint))
            [c] = await replies.until_finished("a")
            assert c.tokens == want
            assert store.num_hits == 1  # fetched once
            # Again: the encoder output is cached (and the prompt's KV): no fetch, no encoder.
            resp = await s.AddRequest(request("b", proc, endpoint, replies.endpoint))
            [c] = await replies.until_finished("b")
            assert c.tokens == want and resp.num_cached_tokens > images[0].end - 4
            assert store.num_hits == 1
            assert counter("llmfleet:encoder_cache_misses", model) - misses0 == 1
            # (the second request's image lies in its prefix-cache hit: never needed)
            assert counter("llmfleet:encoder_cache_hits", model) - hits0 == 0
            hist = REGISTRY.get_sample_value(
                "llmfleet:request_encoder_seconds_count", {"model_name": model}
            )
            assert hist and hist >= 1

            # An image the store does not hold (and the worker never saw).
            other = processed("llava", checkpoint("llava"), prompt_text("llava", 1), [image(8)])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await s.AddRequest(request("c", other, endpoint, replies.endpoint))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "does not hold image" in e.value.details()

            # A placeholder run off the prompt's end is the request's fault.
            bad = request("d", proc, endpoint, replies.endpoint)
            bad.images[0].offset = len(bad.prompt_token_ids) - 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await s.AddRequest(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "images" in e.value.details()
        finally:
            replies.close()
            await w.stop()
            serving.cancel()
            sock.close(0)
            ctx.destroy(0)

    run(body())


def test_text_model_refuses_images(make_checkpoint_module):
    loaded = load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)
    ids = list(range(3, 20))

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded)
        replies = Replies(ctx)
        try:
            pb = add_request_pb("t", ids, GREEDY, replies.endpoint)
            pb.images.add(content_hash="ab" * 32, offset=2, length=4)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub(w).AddRequest(pb)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "images: the served model takes no images" in e.value.details()
        finally:
            replies.close()
            await w.stop()
            ctx.destroy(0)

    run(body())
