"""Rebuilding a gRPC method handler around new behaviour, for server interceptors.

    behavior = handler_behavior(handler)            # the servicer's method, whatever its kind
    return rebuild_handler(handler, wrapped)        # same kind and serializers, new behaviour

A handler is one of four kinds (unary or streaming request, unary or streaming response);
the interceptors (tracing, malformed requests, API keys) wrap its behaviour and need a handler
of the same kind back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

# (request streaming, response streaming) -> the handler factory of that kind of method
_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def handler_behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The function `handler` runs (whichever of its four slots is set)."""
    return (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )


def rebuild_handler(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind running `behavior`, with its serializers (the request
    deserializer replaced when one is given)."""
    make = _FACTORIES[handler.request_streaming, handler.response_streaming]
    return make(
        behavior,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
