"""The worker's `Embed` RPC (unified and prefill roles): token-id inputs pooled by the engine.

    resp = await embed(engine, loop, request_pb)     # EmbedResponse, one embedding per input

Each input becomes one embedding request of the engine's `Pooler` (`<request id>/<i>`), all
validated, then queued, in one engine op, so a batch enters the engine whole or not at all; the
scheduler batches them with everything else running. No KV outlives them (engine/pooling.py).
A call that ends early (the caller cancelled) aborts what is still queued or running; a
forward pass that fails (the engine loop's `failure`) ends the call UNAVAILABLE, so the router
tries another worker.
"""

from __future__ import annotations

import asyncio
import functools
import uuid

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.pooling import PoolingOutput
from llmfleet.services.worker.loop import EngineLoop
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.embedding import check_inputs, pooling_from_pb, response_to_pb
from llmfleet.shared.wire.service import Unavailable
from llmfleet.v1 import embedding_pb2

_FAILURE_CHECK_S = 0.5  # how often a waiting call looks whether the engine loop failed


async def embed(
    engine: LLMEngine, loop: EngineLoop, request: embedding_pb2.EmbedRequest
) -> embedding_pb2.EmbedResponse:
    check_inputs(request)
    params = pooling_from_pb(request)
    inputs: list[list[int]] = []
    for i, inp in enumerate(request.inputs):
        if inp.WhichOneof("input") != "tokens":
            raise ValidationError(
                f"inputs[{i}]", "a worker embeds token ids (the router tokenizes)"
            )
        inputs.append(list(inp.tokens.token_ids))
    rid = request.request_id or uuid.uuid4().hex
    ids = [f"{rid}/{i}" for i in range(len(inputs))]
    event_loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[PoolingOutput]] = [event_loop.create_future() for _ in ids]

    def resolve(fut: asyncio.Future[PoolingOutput], out: PoolingOutput) -> None:
        if not fut.done():
            fut.set_result(out)

    def add() -> None:  # on the engine thread, between steps
        pooler = engine.pooler
        for i, (sid, tokens) in enumerate(zip(ids, inputs, strict=True)):
            pooler.check(sid, tokens, params, field=f"inputs[{i}]")
        for i, (sid, tokens, fut) in enumerate(zip(ids, inputs, futures, strict=True)):
            done = functools.partial(loop.post, resolve, fut)  # on_done(out): to the event loop
            pooler.add(sid, tokens, params, done, field=f"inputs[{i}]")

    def abort() -> None:
        for sid in ids:
            engine.pooler.abort(sid)

    await loop.call(add)
    try:
        pending = set(futures)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=_FAILURE_CHECK_S)
            if pending and loop.failure is not None:
                raise Unavailable(f"the forward pass failed: {loop.failure}")
    except BaseException:
        loop.call_soon(abort)
        raise
    outs = [f.result() for f in futures]
    return response_to_pb(rid, [(o.embedding, o.num_prompt_tokens) for o in outs])
