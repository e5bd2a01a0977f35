"""One tokenizer `Detokenize` stream per completion.

Protocol (tokenizer.proto): a `start` message (no answer), then one `tokens` message per engine
step, each answered by exactly one response with the text safe to emit and, once matched, the
stop string. The start is written when the stream opens, so its cost overlaps the prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from llmfleet.services.worker.engine.sampling_params import SamplingParams
from llmfleet.shared.service import Unavailable
from llmfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class DetokStream:
    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self._call = stub.Detokenize()
        self.closed = False

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        start = tokenizer_pb2.DetokenizeStart(
            prompt_token_ids=prompt_ids,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            keep_special_tokens=not params.skip_special_tokens,
        )
        await self._write(tokenizer_pb2.DetokenizeRequest(start=start))

    async def feed(self, token_ids: Sequence[int], finished: bool) -> tuple[str, str]:
        """Text to emit for these new tokens, and the stop string if one matched."""
        msg = tokenizer_pb2.DetokenizeRequest(
            tokens=tokenizer_pb2.DetokenizeTokens(token_ids=token_ids, finished=finished)
        )
        await self._write(msg)
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"tokenizer: detokenize failed: {exc.details()}") from None
        if resp is grpc.aio.EOF:
            raise Unavailable("tokenizer: detokenize stream ended early")
        return resp.text, resp.stop_string

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._call.cancel()

    async def _write(self, msg: tokenizer_pb2.DetokenizeRequest) -> None:
        try:
            await self._call.write(msg)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            raise Unavailable(f"tokenizer: detokenize failed: {exc}") from None
