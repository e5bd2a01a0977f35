"""Engine hooks the worker builds on: KV export/import, reservations, prefill-only, KV events.

Invariants checked here: imported KV behaves exactly like computed KV (same greedy tokens, and
reported as cached); a reservation filled with exported blocks and started decodes exactly like
a plain run; every way out (finish, abort, release) returns the free-block count to baseline;
drained KV events, applied in order, always equal the cache's hash set.
"""

from __future__ import annotations

import pytest
import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_model
from llmfleet.shared.core.block_hash import HashContext, hash_block_chain
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import CapacityError, ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams

BS = 4


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)


def new_engine(loaded, **kw) -> LLMEngine:
    cfg = dict(block_size=BS, num_kv_blocks=64, max_num_batched_tokens=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded)


def prompt(loaded, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, loaded.spec.vocab_size, (n,), generator=g).tolist()


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run(engine, rid, ids, params=GREEDY, **kw):
    engine.add_request(rid, ids, params, **kw)
    tokens, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens.extend(o.new_token_ids)
                last = o
    return tokens, last


def test_export_import_round_trip_gives_same_tokens_and_cached_count(loaded):
    ids = prompt(loaded, 18)
    a = new_engine(loaded)
    ref, _ = run(a, "r", ids)
    hashes = hash_block_chain(ids, BS, HashContext(model_id=loaded.spec.model_id))
    idle = a.num_free_blocks
    read = a.kv.start_export("put-1", hashes)
    assert read is not None and a.num_free_blocks == idle - 4  # held while they are read
    payload = read.wait()
    a.kv.end_export("put-1")
    assert a.num_free_blocks == idle and payload.shape == (4, *a.kv.block_shape)
    assert a.kv.start_export("put-2", [*hashes, b"\0" * 32]) is None  # one not cached
    assert a.num_free_blocks == idle

    b = new_engine(loaded)
    baseline = b.num_free_blocks
    assert b.kv.import_cached_blocks(hashes, payload) == 4
    assert b.kv.import_cached_blocks(hashes, payload) == 0  # already cached: skipped
    assert b.num_free_blocks == baseline  # imported blocks are unreferenced, still allocatable
    assert sorted(b.kv.cached_block_hashes()) == sorted(hashes)
    got, last = run(b, "r", ids)
    assert got == ref
    assert last.num_cached_tokens == 16
    assert b.num_free_blocks == baseline


def test_reserve_write_start_decode_matches_plain_run(loaded):
    ids = prompt(loaded, 14, seed=1)
    for params in (GREEDY, SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)):
        plain, _ = run(new_engine(loaded), "r", ids, params)

        p = new_engine(loaded)
        base_p = p.num_free_blocks
        p.add_request("r", ids, params, prefill_only=True)
        outs = p.step()
        assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason is None
        first = outs[0].new_token_ids[0]
        assert not p.has_unfinished()
        payload = p.kv.read_blocks(p.kv.pinned_block_ids("r"))
        assert payload.shape[0] == 4  # ceil(14 / 4), the partial last block included
        assert p.kv.release_pinned("r")
        assert p.num_free_blocks == base_p

        d = new_engine(loaded)
        base_d = d.num_free_blocks
        assert d.kv.reserve("lease-1", len(ids)) == 4
        assert d.num_free_blocks == base_d - 4
        d.kv.write_reserved("lease-1", 0, payload[:3])
        d.kv.write_reserved("lease-1", 3, payload[3:])
        d.start_decode("lease-1", "r", ids, first, params)
        rest = []
        while d.has_unfinished():
            for o in d.step():
                rest.extend(o.new_token_ids)
        assert [first, *rest] == plain
        assert d.num_free_blocks == base_d
        # the full prompt blocks entered d's prefix cache
        hashes = hash_block_chain(ids, BS, HashContext(model_id=loaded.spec.model_id))
        assert set(hashes) <= set(d.kv.cached_block_hashes())


def test_every_exit_returns_blocks_to_baseline(loaded):
    e = new_engine(loaded)
    base = e.num_free_blocks
    ids = prompt(loaded, 10, seed=2)
    # reservation released before any write, after a partial write
    e.kv.reserve("l1", 10)
    e.kv.reserve("l2", 10)
    e.kv.write_reserved("l2", 0, torch.zeros(1, *e.kv.block_shape))
    assert e.kv.release_reserved("l1") and e.kv.release_reserved("l2")
    assert not e.kv.release_reserved("l1")
    assert e.num_free_blocks == base
    # prefill-only aborted while queued, while pinned
    e.add_request("p1", ids, GREEDY, prefill_only=True)
    assert e.abort("p1")
    e.step()
    e.add_request("p2", ids, GREEDY, prefill_only=True)
    e.step()
    assert e.abort("p2") and not e.abort("p2")
    # started decode aborted mid-stream; n=2 cancelled one completion at a time
    e.kv.reserve("l3", len(ids))
    e.start_decode("l3", "d1", ids, 5, GREEDY)
    e.step()
    e.abort("d1")
    e.add_request("n2", ids, SamplingParams(n=2, max_tokens=8, temperature=0.0))
    e.step()
    assert e.cancel("n2", index=1)
    e.step()
    assert e.cancel("n2", index=0, stop_string="stop")
    while e.has_unfinished():
        e.step()
    assert e.num_free_blocks == base
    e.kv.reserve("most", 60 * BS)
    with pytest.raises(CapacityError):  # not now: worth waiting for
        e.kv.reserve("more", 5 * BS)
    with pytest.raises(ValidationError, match="^num_prompt_tokens: .* the cache has 8$"):
        new_engine(loaded, num_kv_blocks=8).kv.reserve("never", 9 * BS)  # never fits
    assert e.kv.release_reserved("most")
    assert e.num_free_blocks == base


def test_kv_events_replay_to_the_cache_contents(loaded):
    e = new_engine(loaded, num_kv_blocks=12)
    e.kv.drain_events()
    held: set[bytes] = set()
    for i in range(6):  # more prompts than the cache holds: evictions happen
        run(e, f"r{i}", prompt(loaded, 13, seed=10 + i))
        stored, removed = e.kv.drain_events()
        held.difference_update(removed)
        held.update(stored)
        assert held == set(e.kv.cached_block_hashes())
    assert removed  # the last prompts evicted earlier blocks


def test_step_work_and_queued_prompt_tokens_follow_chunked_prefill(loaded):
    """What the worker reports for routing: each step's (prompt tokens, decoded sequences) for
    its step-time model, and the prompt tokens still queued, as chunked prefill eats them."""
    from llmfleet.services.worker.outputs import IterationFacts

    e = new_engine(loaded, max_num_batched_tokens=48)
    e.add_request("a", prompt(loaded, 100), GREEDY)
    e.add_request("b", prompt(loaded, 30, seed=1), GREEDY)

    def queued() -> int:
        return IterationFacts.read(e, [], 0, spans=False).num_queued_prompt_tokens

    assert queued() == 130
    seen = []
    while e.has_unfinished():
        e.step()
        seen.append((e.last_step_work, queued()))
    assert sum(work[0] for work, _ in seen) == 130  # every prompt token computed once
    assert [q for _, q in seen[:3]] == [82, 34, 0]  # 48 tokens a step: a 48, a 48, a 4 + b 30
    assert seen[2][0] == (34, 0)  # the prompts' last chunks
    assert seen[-1] == ((0, 2), 0)  # then both decode, one token each a step
