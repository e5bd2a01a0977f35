"""The router's Envoy ext_proc v3 endpoint picker, as the Gateway API Inference Extension's EPP:
a proxy in front of the fleet (Envoy, a GIE-conformant gateway) asks it which worker pod serves
each HTTP request, and the router's own routing policy answers (epp_pick.py).

    epp = EndpointPickerServer(config, router, keys)   # --epp-port, on the router's --host
    await epp.start()                 # envoy.service.ext_proc.v3.ExternalProcessor, health,
    await epp.set_serving(True)       # reflection; SERVING while the router serves
    await epp.stop()

One `Process` stream per HTTP request:

    request_headers    a bodiless request is picked now (by load); otherwise the body follows
    request_body       chunks gathered until end_of_stream, then the pick
    response_*         continue (a full-duplex response body is passed back as it came)

The pick is answered in the phase that can still change the request's headers: set
`x-gateway-destination-endpoint: <worker host>:<epp_target_port>` and `x-llmfleet-worker:
<worker address>` (the gateway relays it to the router, which then routes to that worker:
pinning.py), clear the route cache, and dynamic metadata `envoy.lb` {`x-gateway-destination-
endpoint`: the same endpoint} (the GIE protocol: the proxy's original-destination load
balancing reads one or the other). Request body modes:

- BUFFERED (BUFFERED_PARTIAL): the headers are answered at once (the proxy holds them and sends
  the body next); the body's answer carries the mutation.
- FULL_DUPLEX_STREAMED (GIE's setting): the headers' answer waits for the whole body and
  carries the mutation; the body goes back unchanged as one streamed body mutation.
- STREAMED: chunks are answered with continue; the headers have left by the last one, so the
  pick comes too late. Configure one of the above.

A malformed body is an ImmediateResponse 400 in OpenAI's error shape naming the field; no
serving worker (or a tokenizer down) is a 503.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from grpc_health.v1 import health_pb2

from llmfleet.services.router.epp_pick import EndpointPicker, Pick
from llmfleet.services.router.orchestrator import Router
from llmfleet.shared.core.api_keys import KeyRing
from llmfleet.shared.core.config import RouterConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.service import Service, Unavailable
from llmfleet.shared.wire.worker_pin import WORKER_PIN_KEY

logger = logging.getLogger(__name__)

EXT_PROC = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class _Exchange:
    """What one stream (one HTTP request) has seen."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.request_duplex = False
        self.response_duplex = False
        self.answered = False  # the request's pick (or refusal) is sent


def _headers(values: Iterable[base_pb2.HeaderValue]) -> dict[str, str]:
    """Header name (lower case) -> value; Envoy sends values as `raw_value` bytes or `value`."""
    return {
        h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        for h in values
    }


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _continue(phase: str) -> ext_proc.ProcessingResponse:
    """An empty answer for `phase` (a ProcessingResponse field): go on unchanged."""
    resp = ext_proc.ProcessingResponse()
    getattr(resp, phase).SetInParent()
    return resp


def _streamed(phase: str, body: bytes, end_of_stream: bool) -> ext_proc.ProcessingResponse:
    """A full-duplex body chunk passed back unchanged."""
    resp = ext_proc.ProcessingResponse()
    mutation = getattr(resp, phase).response.body_mutation.streamed_response
    mutation.body, mutation.end_of_stream = body, end_of_stream
    return resp


def _immediate(
    code: int, message: str, error_type: str, param: str | None
) -> ext_proc.ProcessingResponse:
    """An HTTP answer from the proxy itself, in OpenAI's error shape."""
    error = {"message": message, "type": error_type, "param": param, "code": None}
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=code),
            headers=ext_proc.HeaderMutation(set_headers=[_set("content-type", "application/json")]),
            body=json.dumps({"error": error}).encode(),
            details=f"llmfleet_epp_{code}",
        )
    )


def routed(phase: str, pick: Pick) -> ext_proc.ProcessingResponse:
    """The answer for `phase` that sends the request to `pick`'s worker."""
    resp = ext_proc.ProcessingResponse()
    common = getattr(resp, phase).response
    common.header_mutation.set_headers.extend(
        [_set(DESTINATION_HEADER, pick.endpoint), _set(WORKER_PIN_KEY, pick.address)]
    )
    common.clear_route_cache = True
    resp.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: pick.endpoint}})
    return resp


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker, max_body_bytes: int) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes  # a larger body is a 413 (the router's own limit)

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        ex = _Exchange()
        async for msg in request_iterator:
            for resp in await self._on(ex, msg):
                yield resp

    async def _on(
        self, ex: _Exchange, msg: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        if msg.HasField("protocol_config"):  # (sent with the first message)
            ex.request_duplex = msg.protocol_config.request_body_mode == _DUPLEX
            ex.response_duplex = msg.protocol_config.response_body_mode == _DUPLEX
        phase = msg.WhichOneof("request")
        if phase == "request_headers":
            ex.headers = _headers(msg.request_headers.headers.headers)
            if msg.request_headers.end_of_stream:
                return [await self._answer(ex, "request_headers")]
            return [] if ex.request_duplex else [_continue("request_headers")]
        if phase == "request_body":
            if ex.answered:  # refused already
                return []
            ex.body += msg.request_body.body
            if len(ex.body) > self.max_body_bytes:
                ex.answered = True
                why = f"the request body is over {self.max_body_bytes} bytes"
                return [_immediate(413, why, "invalid_request_error", None)]
            if msg.request_body.end_of_stream:
                return await self._body_done(ex)
            return [] if ex.request_duplex else [_continue("request_body")]
        if phase == "request_trailers":  # full duplex: a body followed by trailers ends here
            late = ex.request_duplex and not ex.answered
            return [*(await self._body_done(ex) if late else []), _continue("request_trailers")]
        if phase == "response_body" and ex.response_duplex:
            body = msg.response_body
            return [_streamed("response_body", body.body, body.end_of_stream)]
        if phase in ("response_headers", "response_body", "response_trailers"):
            return [_continue(phase)]
        return []

    async def _body_done(self, ex: _Exchange) -> list[ext_proc.ProcessingResponse]:
        if not ex.request_duplex:
            return [await self._answer(ex, "request_body")]
        first = await self._answer(ex, "request_headers")
        if first.HasField("immediate_response"):
            return [first]
        return [first, _streamed("request_body", bytes(ex.body), True)]

    async def _answer(self, ex: _Exchange, phase: str) -> ext_proc.ProcessingResponse:
        """The pick for the request seen so far, as the answer for `phase`, or its refusal."""
        ex.answered = True
        path = ex.headers.get(":path", "")
        try:
            pick = await self.picker.pick(path, bytes(ex.body), ex.headers)
        except ValidationError as exc:
            logger.debug("endpoint picker: %s: %s", path, exc)
            return _immediate(400, str(exc), "invalid_request_error", exc.field)
        except Unavailable as exc:
            logger.info("endpoint picker: %s: %s", path, exc)
            return _immediate(503, str(exc), "service_unavailable_error", None)
        return routed(phase, pick)


class EndpointPickerServer:
    """The picker's own gRPC server on `config.epp_port` (which must be set) of `config.host`."""

    def __init__(self, config: RouterConfig, router: Router, keys: KeyRing | None = None) -> None:
        if config.epp_port is None:
            raise ValidationError("epp_port", "the endpoint picker needs a port")
        self.service = Service("router", config.host, config.epp_port, metrics_port=None)
        picker = EndpointPicker(router, config.epp_target_port, keys)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(picker, config.max_message_bytes), self.service.server
        )

    @property
    def address(self) -> str:
        return self.service.address

    async def start(self) -> None:
        await self.service.start([EXT_PROC])  # NOT_SERVING until the router serves
        logger.info("endpoint picker (ext_proc) on %s", self.address)

    async def set_serving(self, serving: bool) -> None:
        health = health_pb2.HealthCheckResponse
        for name in ("", EXT_PROC):
            await self.service.health.set(name, health.SERVING if serving else health.NOT_SERVING)

    async def stop(self) -> None:
        await self.set_serving(False)
        await self.service.server.stop(0)
