"""Coalescing a request's waiting output events into one stream message (replies.py,
request.py)."""

from __future__ import annotations

import asyncio

from llmfleet.services.router.replies import merge_outputs
from llmfleet.services.router.request import Outputs, take_ready
from llmfleet.v1 import common_pb2, dataplane_pb2

FR = common_pb2.FinishReason


def out(index: int, ids: list[int], **kw: object) -> dataplane_pb2.SequenceOutput:
    return dataplane_pb2.SequenceOutput(request_id="r", index=index, token_ids=ids, **kw)


def test_merge_outputs_joins_steps_per_index_in_order() -> None:
    lp = [common_pb2.PositionLogprobs() for _ in range(3)]
    outs = [
        out(0, [1], logprobs=[lp[0]], num_cached_tokens=16),
        out(1, [7]),
        out(0, [2, 3], logprobs=lp[1:]),
        out(1, [8], finish_reason=FR.FINISH_REASON_STOP, stop_token_id=8),
    ]
    merged = merge_outputs(outs)
    assert [(m.index, list(m.token_ids)) for m in merged] == [(0, [1, 2, 3]), (1, [7, 8])]
    assert len(merged[0].logprobs) == 3 and merged[0].num_cached_tokens == 16
    assert merged[0].finish_reason == FR.FINISH_REASON_UNSPECIFIED
    assert merged[1].finish_reason == FR.FINISH_REASON_STOP
    assert merged[1].HasField("stop_token_id") and merged[1].stop_token_id == 8
    single = [out(0, [1]), out(1, [2])]
    assert merge_outputs(single) is single


def test_take_ready_joins_one_legs_waiting_steps_and_stops_at_anything_else() -> None:
    async def go() -> None:
        q: asyncio.Queue[object] = asyncio.Queue()
        leg, other = object(), object()

        def ev(which: object, worker: str, ids: list[int], t: float) -> Outputs:
            return Outputs(which, worker, [out(0, ids)], [t])  # type: ignore[arg-type]

        for e in [ev(leg, "w0", [2], 2.0), ev(leg, "w0", [3], 3.0), ev(other, "w0", [9], 4.0)]:
            q.put_nowait(e)
        q.put_nowait("failed")
        merged, carried = take_ready(q, ev(leg, "w0", [1], 1.0))
        assert merged.leg is leg and [list(o.token_ids) for o in merged.outs] == [[1, 2, 3]]
        assert merged.arrived == [1.0, 2.0, 3.0]  # each step's arrival, for TTFT and ITL
        assert isinstance(carried, Outputs) and carried.leg is other
        assert q.get_nowait() == "failed" and q.empty()
        alone = ev(leg, "w0", [4], 5.0)
        assert take_ready(q, alone) == (alone, None)  # nothing waiting: unchanged
        q.put_nowait(ev(leg, "w1", [5], 6.0))  # the same leg from another worker
        merged, carried = take_ready(q, alone)
        assert merged is alone and isinstance(carried, Outputs) and carried.worker_id == "w1"

    asyncio.run(go())
