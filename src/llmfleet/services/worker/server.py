"""The worker service: the `llmfleet.v1.Worker` servicer around one engine core (any role).

    server = await serve(WorkerConfig(role="decode"), EngineConfig(...))   # SERVING when warm
    ... server.address, server.kv_endpoint, server.kv_events_endpoint ...
    await server.stop()                                                   # drain and close

The servicer is the RPC surface of a `WorkerRuntime` (runtime.py: engine, loop, sockets,
lifecycle): handlers check the role, convert protobuf at the boundary and hand the work to the
runtime, the decode side (decode_side.py: leases) or the prefill side (prefill_side.py); typed
errors become status codes through `abort_with`.
"""

from __future__ import annotations

import logging

import grpc

from llmfleet.models.loader import LoadedModel
from llmfleet.services.worker.decode_side import DecodeSide
from llmfleet.services.worker.embed import embed
from llmfleet.services.worker.prefill_side import Cancelled
from llmfleet.services.worker.runtime import SERVICE_NAME, WorkerRuntime
from llmfleet.services.worker.speculation import spec_decode_stats
from llmfleet.shared.core.config import EngineConfig, WorkerConfig
from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.wire.convert import ROLE_TO_PB, images_from_pb, sampling_from_pb
from llmfleet.shared.wire.service import FailedPrecondition, abort_with
from llmfleet.v1 import common_pb2, embedding_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

__all__ = ["SERVICE_NAME", "WorkerServer", "serve"]


class WorkerServer(WorkerRuntime, worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        worker_config: WorkerConfig,
        engine_config: EngineConfig,
        loaded_model: LoadedModel | None = None,
        *,
        grace_s: float = 30.0,
    ) -> None:
        super().__init__(worker_config, engine_config, loaded_model, grace_s=grace_s)
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.service.server)

    # ---- RPCs --------------------------------------------------------------------------------
    async def AddRequest(
        self, request: worker_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AddRequestResponse:
        try:
            if not request.reply_endpoint:
                raise ValidationError("reply_endpoint", "must be set")
            params = sampling_from_pb(request.sampling)
            prompt = list(request.prompt_token_ids)
            num_cached = await self.admission.admit(
                request.request_id,
                prompt,
                params,
                request.cache_salt,
                reply_endpoint=request.reply_endpoint,
                prefill_only=False,
                replayed=request.num_replayed_tokens,
                images=images_from_pb(request.images, len(prompt), "images"),
            )
        except LLMFleetError as e:
            await abort_with(context, e)
        return worker_pb2.AddRequestResponse(num_cached_tokens=num_cached)

    async def Cancel(
        self, request: worker_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelResponse:
        try:
            engine, loop = self._running_loop()
        except LLMFleetError as e:
            await abort_with(context, e)
        index = request.index if request.HasField("index") else None
        stop = request.stop_string if request.reason == common_pb2.FINISH_REASON_STOP else None
        rid = request.request_id

        def cancel() -> bool:
            found = engine.cancel(rid, index, stop)
            # Aborts emit a final output, whose delivery drops the route; a stop does not.
            if stop is not None:
                if found:
                    loop.post(self.request_spans.stopped, rid, index)
                if not engine.has_request(rid):
                    self._routes.pop(rid, None)
            return found

        return worker_pb2.CancelResponse(found=await loop.call(cancel))

    async def GetWorkerStats(
        self, request: worker_pb2.GetWorkerStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetWorkerStatsResponse:
        try:
            engine, loop = self._running_loop()
        except LLMFleetError as e:
            await abort_with(context, e)
        if self.decode is not None:
            self.decode.reap()
        load = await loop.call(self._load_report)  # between steps: a consistent view
        spec_decode = await loop.call(spec_decode_stats, engine)
        stats = engine.block_manager.stats
        resp = worker_pb2.GetWorkerStatsResponse(
            worker_id=self.worker_id,
            role=ROLE_TO_PB[self.role],
            load=load,
            prefix_cache_queries=stats.num_queries,
            prefix_cache_hits=stats.num_hits,
            kvstore_blocks_fetched=self.kvstore.num_blocks_fetched if self.kvstore else 0,
            kvstore_blocks_stored=self.kvstore.num_blocks_stored if self.kvstore else 0,
            kvstore_view_blocks=self.kvstore.num_view_blocks if self.kvstore else None,
            kvstore_lookups_skipped=self.kvstore.num_lookups_skipped if self.kvstore else 0,
            kvstore_blocks_dropped=self.kvstore.num_blocks_dropped if self.kvstore else 0,
            spec_decode=spec_decode,
        )
        if self.prefill is not None:
            pusher = self.prefill.pusher
            resp.kv_pushed_bytes, resp.kv_push_us = pusher.pushed_bytes, pusher.push_us
            resp.kv_pushes_gpu, resp.kv_pushes_host = pusher.pushes_gpu, pusher.pushes_host
        return resp

    async def GetKVSnapshot(
        self, request: worker_pb2.GetKVSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetKVSnapshotResponse:
        if self.publisher is None:
            await abort_with(context, FailedPrecondition("the worker is not serving"))
        snap = self.publisher.snapshot()
        return worker_pb2.GetKVSnapshotResponse(
            publisher_id=self.worker_id,
            seq=snap.seq,
            block_hashes=snap.block_hashes,
            epoch=snap.epoch,
        )

    # ---- lease handoff (decode_side.py, prefill_side.py) ---------------------------------------
    def _decode_side(self, rpc: str) -> DecodeSide:
        self._require_role(rpc, "decode", "unified")
        self._running_loop()  # a lease granted before a drain still starts its decode
        if self.decode is None:
            raise FailedPrecondition("the worker is not serving")
        return self.decode

    async def ReserveKV(
        self, request: worker_pb2.ReserveKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveKVResponse:
        try:
            self._engine_loop()  # a draining worker grants no new lease
            lease = await self._decode_side("ReserveKV").reserve(request)
        except LLMFleetError as e:
            await abort_with(context, e)
        return worker_pb2.ReserveKVResponse(lease=lease)

    async def StartDecode(
        self, request: worker_pb2.StartDecodeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StartDecodeResponse:
        try:
            await self._decode_side("StartDecode").start_decode(request)
        except LLMFleetError as e:
            await abort_with(context, e)
        return worker_pb2.StartDecodeResponse()

    async def ReleaseKV(
        self, request: worker_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKVResponse:
        try:
            self._running_loop()
        except LLMFleetError as e:
            await abort_with(context, e)
        released = self.decode is not None and await self.decode.release(request)
        return worker_pb2.ReleaseKVResponse(released=released)

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        try:
            self._require_role("Prefill", "prefill", "unified")
            self._engine_loop()
            if self.prefill is None:
                raise FailedPrecondition("the worker is not serving")
            return await self.prefill.prefill(request)
        except Cancelled as e:
            await context.abort(grpc.StatusCode.CANCELLED, str(e))
            raise  # unreachable: abort raises
        except LLMFleetError as e:
            await abort_with(context, e)
            raise  # unreachable: abort_with raises

    async def Embed(
        self, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        try:
            self._require_role("Embed", "unified", "prefill")
            return await embed(*self._engine_loop(), request)  # embed.py
        except LLMFleetError as e:
            await abort_with(context, e)
            raise  # unreachable: abort_with raises


async def serve(
    worker_config: WorkerConfig,
    engine_config: EngineConfig,
    loaded_model: LoadedModel | None = None,
    *,
    install_signal_handlers: bool = False,
    grace_s: float = 30.0,
) -> WorkerServer:
    """Start a worker in this event loop; returns it once started (SERVING once the model is
    loaded and, with a router configured, registered)."""
    server = WorkerServer(worker_config, engine_config, loaded_model, grace_s=grace_s)
    if install_signal_handlers:
        server.install_signal_handlers()
    try:
        await server.start()
    except BaseException:
        await server.stop(grace_s=0)
        raise
    return server
