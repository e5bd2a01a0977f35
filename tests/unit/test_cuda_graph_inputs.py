"""The host side of CUDA-graph decode: batch-size buckets, padded inputs, the config knob.

Pure CPU; the graphs themselves are tested on the GPU (tests/engine/test_cuda_graphs.py) and the
padded metadata through the Triton kernels in tests/kernels/test_decode_padding.py.
"""

from __future__ import annotations

import pytest
import torch

from llmfleet.engine.cuda_graphs import (
    DecodeBuffers,
    PaddedDecoder,
    capture_sizes,
    padded_size,
)
from llmfleet.engine.engine import LLMEngine
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.loader import load_model
from llmfleet.services.worker.__main__ import parse_config
from llmfleet.shared.core.config import EngineConfig, from_env
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.speculative import SpeculativeConfig


def test_capture_sizes_cover_every_batch_up_to_the_max():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-6:] == [112, 128, 160, 192, 224, 256]
    with pytest.raises(ValueError):
        capture_sizes(0)
    for limit in (1, 5, 64, 100, 300):
        sizes = capture_sizes(limit)
        assert sizes == sorted(set(sizes))
        for n in range(1, limit + 1):
            b = padded_size(n, sizes)
            assert b is not None and b >= n
            assert all(s < n for s in sizes if s < b)  # the smallest size that fits
        assert padded_size(limit + 1, sizes) is None


def test_padded_size_examples():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 17, 33, 64)] == [1, 2, 4, 8, 24, 48, 64]


def _buffers() -> DecodeBuffers:
    return DecodeBuffers(max_batch_size=8, max_blocks_per_seq=4, block_size=4)


def test_fill_matches_unpadded_metadata_and_pads():
    bufs = _buffers()
    tables = [[5], [2, 7, 1], [3, 6]]
    positions = [0, 9, 4]  # seq lens 1, 10, 5
    ids = [11, 12, 13]
    bufs.fill(ids, positions, tables, 4)
    ref = AttentionMetadata.build([1, 1, 1], [p + 1 for p in positions], tables, 4)
    assert bufs.token_ids(4).tolist() == [11, 12, 13, 0]
    assert bufs.positions(4).tolist() == [0, 9, 4, 0]
    assert bufs.slot_mapping(4).tolist() == ref.slot_mapping.tolist() + [-1]
    assert bufs.slot_mapping(4).tolist() == [20, 1 * 4 + 1, 6 * 4 + 0, -1]
    assert bufs.seq_lens(4).tolist() == [1, 10, 5, 1]
    bt = bufs.block_tables(4)
    assert bt.shape == (4, 4) and bt.dtype == torch.int32 and bt.is_contiguous()
    for i, t in enumerate(tables):
        assert bt[i, : len(t)].tolist() == t
    assert bt[3, 0].item() == 0  # padding reads block 0, slot 0 only


def test_refill_with_fewer_sequences_resets_padding_rows():
    bufs = _buffers()
    bufs.fill([1] * 6, [5] * 6, [[1, 2]] * 6, 8)
    bufs.fill([7], [2], [[3]], 2)
    assert bufs.token_ids(2).tolist() == [7, 0]
    assert bufs.slot_mapping(2).tolist() == [3 * 4 + 2, -1]
    assert bufs.seq_lens(2).tolist() == [3, 1]
    assert bufs.block_tables(2)[:, 0].tolist() == [3, 0]


def test_refills_follow_growing_moved_and_replaced_block_tables():
    """Rows keep what an earlier fill wrote when the same (growing) list comes back; a
    grown table gets its new block, a table at another row or a new list is written whole,
    and a padding row forgets its table."""
    bufs = _buffers()
    a, b = [5], [2, 7]
    bufs.fill([1, 2], [3, 6], [a, b], 2)
    a.append(6)  # the block manager's live list grew
    bufs.fill([1, 2], [4, 7], [a, b], 2)
    assert bufs.block_tables(2)[0, :2].tolist() == [5, 6]
    assert bufs.slot_mapping(2).tolist() == [6 * 4 + 0, 7 * 4 + 3]
    bufs.fill([2, 1], [7, 5], [b, a], 2)  # the rows swap: both rewritten
    assert bufs.block_tables(2)[:, :2].tolist() == [[2, 7], [5, 6]]
    assert bufs.slot_mapping(2).tolist() == [7 * 4 + 3, 6 * 4 + 1]
    c = [9, 8]  # another list of the same length at row 0
    bufs.fill([3, 1], [5, 5], [c, a], 2)
    assert bufs.block_tables(2)[0, :2].tolist() == [9, 8]
    bufs.fill([1], [5], [a], 2)  # row 1 becomes padding
    bufs.fill([1, 2], [5, 6], [a, b], 2)  # and b comes back to it
    assert bufs.block_tables(2)[1, :2].tolist() == [2, 7]
    assert bufs.slot_mapping(2).tolist() == [6 * 4 + 1, 7 * 4 + 2]


def test_views_alias_the_buffers_and_copy_takes_the_table_prefix():
    host, dev = _buffers(), _buffers()
    meta = dev.metadata(2, max_seq_len=16)  # what a graph captures: views, then reads later
    host.fill([4, 5], [1, 6], [[2], [0, 3]], 2)
    dev.copy_from(host, 2)
    assert meta.slot_mapping.tolist() == [9, 14]
    assert meta.seq_lens.tolist() == [2, 7]
    assert meta.block_tables[1, :2].tolist() == [0, 3]
    assert meta.max_seq_len == 16 and meta.is_pure_decode and meta.num_tokens == 2
    assert dev.block_tables(8)[2:].abs().sum().item() == 0  # rows past the batch not copied


def test_copy_keeps_the_token_ids_already_on_the_device():
    host, dev = _buffers(), _buffers()
    dev.token_ids(4).copy_(torch.tensor([70, 71, 72, 73]))  # stale: rows 2, 3 become padding
    host.fill([0, 0], [1, 6], [[2], [0, 3]], 4)  # the step's tokens are not known here
    dev.token_ids(2).copy_(torch.tensor([40, 41]))  # ... but already on the device
    dev.copy_from(host, 4, keep_ids=2)
    assert dev.token_ids(4).tolist() == [40, 41, 0, 0]  # padding rows get token 0
    assert dev.positions(2).tolist() == [1, 6]
    assert dev.slot_mapping(4).tolist() == [9, 14, -1, -1]
    assert dev.seq_lens(2).tolist() == [2, 7]


def test_fill_rejects_what_does_not_fit():
    bufs = _buffers()
    assert not bufs.fits([0] * 9, [[0]] * 9)
    assert not bufs.fits([0], [[0] * 5])
    assert bufs.fits([15], [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="batch size"):
        bufs.fill([1, 2], [0, 0], [[0], [0]], 1)
    with pytest.raises(ValueError, match="position 4"):
        bufs.fill([1], [4], [[0]], 1)


def test_engine_config_knob():
    assert EngineConfig().cuda_graph_max_batch_size is None  # unset: follows max_num_seqs
    assert EngineConfig().resolved().cuda_graph_max_batch_size == 64
    gpu = EngineConfig(device="cuda", dtype="bfloat16")
    assert gpu.resolved().cuda_graph_max_batch_size == 256
    assert (
        EngineConfig(device="cuda", max_num_seqs=1024).resolved().cuda_graph_max_batch_size == 512
    )
    # with drafts a step brings up to 1 + k rows a sequence
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    drafting = EngineConfig(device="cuda", max_num_seqs=64, speculative=spec).resolved()
    assert drafting.cuda_graph_max_batch_size == drafting.decode_rows == 320
    assert EngineConfig(cuda_graph_max_batch_size=0).cuda_graph_max_batch_size == 0
    with pytest.raises(ValidationError, match="cuda_graph_max_batch_size"):
        EngineConfig(cuda_graph_max_batch_size=-1)
    env = {"LLMFLEET_CUDA_GRAPH_MAX_BATCH_SIZE": "16"}
    assert from_env(EngineConfig, env).cuda_graph_max_batch_size == 16
    _, engine, _ = parse_config(["--cuda-graph-max-batch-size", "0"])
    assert engine.cuda_graph_max_batch_size == 0


def test_a_backend_that_is_not_graph_safe_keeps_the_engine_eager(make_checkpoint, tmp_path, caplog):
    loaded = load_model(str(make_checkpoint("llama", tmp_path)), progress=False)
    assert loaded.model.backend.name == "torch_reference"
    engine = LLMEngine(EngineConfig(num_kv_blocks=8), loaded)
    engine.runner.capture_decode_graphs(4, 64)
    assert engine.runner.decode_graphs is None
    assert "cannot run inside CUDA graphs" in caplog.text
    with pytest.raises(ValueError, match="torch_reference"):
        PaddedDecoder(
            loaded.model, engine.runner.kv_caches, max_batch_size=4, max_model_len=64, vocab_size=8
        )
