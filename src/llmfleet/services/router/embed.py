"""The router's `Embed`: validate, tokenize text inputs, send the batch to one worker.

    embedder = Embedder(router)
    resp = await embedder.embed(request_pb, trace_ctx)     # EmbedResponse

Per call: the inputs' shape and the pooling parameters are checked (INVALID_ARGUMENT naming
`inputs`, `inputs[i]`, `pooling` or `dimensions`); admission counts the call among the router's
queued requests (RESOURCE_EXHAUSTED beyond `max_queued_requests`); text inputs are tokenized
by the tokenizer service as raw text (no chat template), token inputs are checked against the
vocabulary and every input against the context length. The whole batch goes to the least
loaded live unified or prefill worker (its last load report plus the embeddings this router has
sent it since); a worker that is gone, draining or full (UNAVAILABLE, FAILED_PRECONDITION,
RESOURCE_EXHAUSTED) is left for another, up to `max_retries` times. Whether the model may
shorten its embeddings (`dimensions`) is the worker's to say.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import grpc
from opentelemetry.context import Context

from llmfleet.services.router.orchestrator import Router
from llmfleet.services.router.placement import CONTROL_TIMEOUT_S, field_error
from llmfleet.services.router.registry import ROLE_PREFILL, ROLE_UNIFIED, WorkerInfo
from llmfleet.shared.core.errors import CapacityError, ValidationError
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.wire.embedding import check_inputs, pooling_from_pb, token_inputs
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.tracing import metadata
from llmfleet.v1 import embedding_pb2, tokenizer_pb2

_ELSEWHERE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


class Embedder:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.num_active = 0  # calls admitted, not yet answered
        self._sent: Counter[str] = Counter()  # worker id -> embedding calls in flight there

    async def embed(
        self, req: embedding_pb2.EmbedRequest, trace: Context | None = None
    ) -> embedding_pb2.EmbedResponse:
        router = self.router
        check_inputs(req)
        pooling_from_pb(req)  # its field errors, before any work
        if router.draining:
            raise Unavailable("the router is draining")
        model = router.model()
        if model is None or not self._workers():
            raise Unavailable("no live worker serves embeddings")
        queued = len(router.runs) + self.num_active
        if queued >= router.config.max_queued_requests:
            raise CapacityError(
                f"{router.config.max_queued_requests} requests are queued or running; retry later"
            )
        self.num_active += 1
        try:
            ids = await asyncio.gather(
                *(self._token_ids(i, inp, model, trace) for i, inp in enumerate(req.inputs))
            )
            worker_req = embedding_pb2.EmbedRequest(
                request_id=req.request_id or uuid.uuid4().hex, inputs=token_inputs(ids)
            )
            worker_req.pooling = req.pooling
            if req.HasField("normalize"):
                worker_req.normalize = req.normalize
            if req.HasField("dimensions"):
                worker_req.dimensions = req.dimensions
            return await self._send(worker_req, trace)
        finally:
            self.num_active -= 1

    def _workers(self) -> list[WorkerInfo]:
        reg = self.router.registry
        return [*reg.live(ROLE_UNIFIED), *reg.live(ROLE_PREFILL)]

    async def _token_ids(
        self, i: int, inp: embedding_pb2.EmbedInput, model: ModelInfo, trace: Context | None
    ) -> list[int]:
        field, limit = f"inputs[{i}]", model.max_model_len
        if inp.WhichOneof("input") == "tokens":
            ids = list(inp.tokens.token_ids)
            for pos, t in enumerate(ids):
                if not 0 <= t < model.vocab_size:
                    raise ValidationError(
                        field,
                        f"token id {t} at position {pos} is outside the vocabulary "
                        f"[0, {model.vocab_size})",
                    )
        else:
            tok_req = tokenizer_pb2.TokenizeRequest(text=inp.text, max_num_tokens=limit)
            try:
                resp = await self.router.tokenizer.Tokenize(
                    tok_req, timeout=CONTROL_TIMEOUT_S, metadata=metadata(trace)
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValidationError(
                        field, field_error(exc.details(), field).message
                    ) from None
                raise Unavailable(f"tokenizer: {exc.code().name}: {exc.details()}") from None
            ids = list(resp.token_ids)
            if not ids:
                raise ValidationError(field, "the text has no tokens")
        if len(ids) > limit:
            raise ValidationError(
                field,
                f"has {len(ids)} tokens, more than the context length of {limit} tokens",
            )
        return ids

    async def _send(
        self, req: embedding_pb2.EmbedRequest, trace: Context | None
    ) -> embedding_pb2.EmbedResponse:
        """`req` (token inputs) on the least loaded worker, retried elsewhere when one is gone,
        draining or full."""
        tried: set[str] = set()
        last: grpc.aio.AioRpcError | None = None
        for _ in range(self.router.config.max_retries + 1):
            candidates = [w for w in self._workers() if w.worker_id not in tried]
            stub, worker = None, None
            while candidates and stub is None:
                worker = min(candidates, key=self._load)
                candidates.remove(worker)
                stub = self.router.pool.stub(worker.worker_id)
            if stub is None or worker is None:
                break
            wid = worker.worker_id
            tried.add(wid)
            self._sent[wid] += 1
            try:
                return await stub.Embed(req, metadata=metadata(trace))
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                    raise field_error(exc.details(), "inputs") from None
                if exc.code() not in _ELSEWHERE:
                    raise Unavailable(f"worker {wid}: {exc.code().name}: {exc.details()}") from None
                last = exc
            finally:
                self._sent[wid] -= 1
                if not self._sent[wid]:
                    del self._sent[wid]
        if last is not None and last.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise CapacityError(f"every worker tried is full: {last.details()}")
        why = f": {last.code().name}: {last.details()}" if last is not None else ""
        raise Unavailable(f"no worker could embed the request{why}")

    def _load(self, w: WorkerInfo) -> tuple[int, int]:
        return (w.load.num_requests + self._sent[w.worker_id], w.load.num_queued_prompt_tokens)
