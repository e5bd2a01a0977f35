"""What the tokenizer service tests share: the bundled tokenizer, a sample text, and a service
started in process over loopback gRPC."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from llmfleet.services.tokenizer.server import start
from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.v1 import tokenizer_pb2_grpc

TEXT = (
    "The quick brown fox jumps over the lazy dog. 世界你好 🎉 héllo café. STOP here; "
    "then more text after the stop."
)


@contextlib.asynccontextmanager
async def serving(tokenizer: Any) -> AsyncIterator[tuple[tokenizer_pb2_grpc.TokenizerStub, str]]:
    svc = await start(TokenizerConfig(port=0), tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(svc.address)
    try:
        yield tokenizer_pb2_grpc.TokenizerStub(channel), svc.address
    finally:
        await channel.close()
        svc.request_stop()
        await svc.wait_for_termination()
