"""The ops rank 0 sends its follower ranks: a STEP and a DECODE survive encoding, in the flat
int layout the followers size their receive buffers by."""

from __future__ import annotations

from llmfleet.engine.model_runner import StepInputs
from llmfleet.engine.tp_step import decode_decode, decode_step, encode_decode, encode_step


def body_size(op_counts: list[int], decode: bool) -> int:
    """What `StepChannel.recv` allocates for an op's body (mirrors its arithmetic)."""
    n_tok, n_seq, n_table, n_sample = [*op_counts, 0][:4]
    if decode:
        return 2 * n_tok + n_seq + (0 if n_table else n_tok)
    return 2 * n_tok + 3 * n_seq + n_table + n_sample


def test_step_round_trips():
    step = StepInputs(
        input_ids=[5, 6, 7, 9],
        positions=[0, 1, 2, 7],
        query_lens=[3, 1],
        seq_lens=[3, 8],
        block_tables=[[4], [1, 2]],
        sample_tokens=[2, 3],
    )
    counts, body = encode_step(step)
    assert len(body) == body_size(counts, decode=False)
    assert decode_step(counts, body) == step


def test_decode_round_trips_with_host_and_device_token_ids():
    positions, tables = [7, 0, 33], [[1, 2], [9], [3, 4, 5]]
    counts, body = encode_decode(positions, tables, [11, 12, 13])
    assert len(body) == body_size(counts, decode=True)
    got = decode_decode(counts, body)
    assert (got.positions, got.block_tables, got.token_ids) == (positions, tables, [11, 12, 13])
    counts, body = encode_decode(positions, tables, None)  # ids follow as a device broadcast
    assert len(body) == body_size(counts, decode=True)
    got = decode_decode(counts, body)
    assert (got.positions, got.block_tables, got.token_ids) == (positions, tables, None)
