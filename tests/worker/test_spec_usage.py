"""Per-request draft counts on their way to the client: the worker sends each sequence's
increase since its previous output, the router sums what it joins and what every worker of a
request reported, and the usage carries the totals."""

from __future__ import annotations

from llmfleet.engine.request import RequestOutput
from llmfleet.services.router.replies import merge_outputs
from llmfleet.services.worker.outputs import sequence_output_to_pb
from llmfleet.services.worker.speculation import DraftCounts
from llmfleet.v1 import dataplane_pb2


def output(rid: str, index: int, drafted: int, accepted: int, finished=False) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        index=index,
        new_token_ids=[1],
        new_logprobs=[None],
        finished=finished,
        finish_reason="length" if finished else None,
        stop_reason=None,
        num_prompt_tokens=4,
        num_cached_tokens=0,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
    )


def test_outputs_carry_the_increase_since_the_previous_one():
    counts = DraftCounts()
    assert counts.delta(output("a", 0, 0, 0)) == (0, 0)  # no drafts yet: nothing kept
    assert counts.delta(output("a", 0, 4, 3)) == (4, 3)
    assert counts.delta(output("a", 1, 4, 1)) == (4, 1)  # another completion of it
    assert counts.delta(output("a", 0, 8, 7)) == (4, 4)
    assert counts.delta(output("a", 0, 8, 7)) == (0, 0)  # a step without drafts
    assert counts.delta(output("a", 0, 12, 8, finished=True)) == (4, 1)
    assert counts.delta(output("a", 1, 4, 1, finished=True)) == (0, 0)
    assert counts._sent == {}  # finished sequences are forgotten
    pb = sequence_output_to_pb(output("b", 0, 8, 5), (4, 2))
    assert (pb.num_draft_tokens, pb.num_accepted_tokens) == (4, 2)


def test_joined_steps_sum_their_draft_counts():
    outs = [
        dataplane_pb2.SequenceOutput(
            request_id="a", index=0, token_ids=[1, 2], num_draft_tokens=3, num_accepted_tokens=1
        ),
        dataplane_pb2.SequenceOutput(
            request_id="a", index=1, token_ids=[5], num_draft_tokens=3, num_accepted_tokens=0
        ),
        dataplane_pb2.SequenceOutput(
            request_id="a", index=0, token_ids=[3, 4, 6], num_draft_tokens=3, num_accepted_tokens=2
        ),
    ]
    merged = {m.index: m for m in merge_outputs(outs)}
    assert list(merged[0].token_ids) == [1, 2, 3, 4, 6]
    assert (merged[0].num_draft_tokens, merged[0].num_accepted_tokens) == (6, 3)
    assert (merged[1].num_draft_tokens, merged[1].num_accepted_tokens) == (3, 0)
