"""A tensor-parallel engine's ranks (two CPU processes, gloo) from start to close: the KV cache
takes the block count of the rank whose memory holds the fewest, and closing lets every
follower leave the group and exit 0 by itself, promptly (no kill)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from llmfleet.engine import forward_pass
from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.engine.model_runner import kv_bytes_per_block
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CLOSE_WITHIN_S = 5.0


def config(path, tp: int, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), tensor_parallel_size=tp, block_size=4, num_threads=1, **kw)


def tokens(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("r", prompt, GREEDY)
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def close_and_time(close, procs) -> float:
    start = time.monotonic()
    close()
    for proc in procs:  # (close has waited for them: this returns at once)
        proc.wait(timeout=CLOSE_WITHIN_S)
    return time.monotonic() - start


def test_closing_an_engine_lets_every_follower_exit_0_by_itself(make_checkpoint_module, caplog):
    caplog.set_level(logging.WARNING, logger="llmfleet.engine.tp_ranks")
    cfg = config(make_checkpoint_module("llama"), 2, num_kv_blocks=32)
    two = LLMEngine(cfg, load_for(cfg))
    procs = two.runner.ranks.procs
    assert len(tokens(two, list(range(3, 20)))) == 6
    elapsed = close_and_time(two.close, procs)
    assert [p.returncode for p in procs] == [0]  # a killed follower's would be -9
    assert elapsed < CLOSE_WITHIN_S
    assert "killing" not in caplog.text and "not delivered" not in caplog.text
    assert not torch.distributed.is_initialized()  # rank 0 left the group too


def test_ranks_closed_before_the_engine_starts_exit_0_by_themselves(make_checkpoint_module):
    cfg = config(make_checkpoint_module("llama"), 2, num_kv_blocks=32)
    loaded = load_for(cfg)  # the followers loaded their shards and wait for their first op
    procs = loaded.ranks.procs
    assert close_and_time(loaded.ranks.close, procs) < CLOSE_WITHIN_S
    assert [p.returncode for p in procs] == [0]


def test_the_kv_cache_takes_the_block_count_of_the_rank_with_the_least_memory(
    make_checkpoint_module, monkeypatch
):
    """Rank 0's memory holds four times the blocks the follower's does (as on a GPU with more
    free memory): the engine, and so every rank, gets the follower's count."""
    real = forward_pass.num_kv_blocks
    monkeypatch.setattr(  # only in this process, rank 0's: the follower counts as it is
        forward_pass, "num_kv_blocks", lambda *a, **kw: 4 * real(*a, **kw)
    )
    path = make_checkpoint_module("llama")  # 2 KV heads: one on each rank
    cfg = config(path, 2, kv_cache_bytes=64 << 10)
    two = LLMEngine(cfg, load_for(cfg))
    try:
        block_bytes = kv_bytes_per_block(two.spec, 4, torch.float32)
        assert two.spec.num_kv_heads == 1 and block_bytes == 1024  # a rank's share of a block
        assert two.block_manager.num_blocks == 64  # 64 KiB of 1 KiB blocks, not 4 x 64
        assert two.num_free_blocks == 64
        # A prompt filling most of those blocks runs on both ranks' caches.
        long = torch.randint(3, 250, (200,), generator=torch.Generator().manual_seed(0))
        assert len(tokens(two, long.tolist())) == 6
    finally:
        two.close()
    assert [p.returncode for p in two.runner.ranks.procs] == [0]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_closing_a_tp2_engine_on_two_gpus_lets_the_follower_exit_0_by_itself(
    make_checkpoint_module, caplog
):
    """NCCL tears its communicator down collectively: rank 0 leaves the group with the
    follower instead of waiting for it to exit (which left it blocked until killed)."""
    caplog.set_level(logging.WARNING, logger="llmfleet.engine.tp_ranks")
    path = make_checkpoint_module("llama")
    cfg = EngineConfig(
        model=str(path), device="cuda", tensor_parallel_size=2, cuda_graph_max_batch_size=4,
        block_size=4, num_threads=1,
    )  # fmt: skip
    two = LLMEngine(cfg, load_for(cfg))
    procs = two.runner.ranks.procs
    assert len(tokens(two, list(range(3, 20)))) == 6
    elapsed = close_and_time(two.close, procs)
    assert [p.returncode for p in procs] == [0]
    assert elapsed < CLOSE_WITHIN_S
    assert "killing" not in caplog.text
