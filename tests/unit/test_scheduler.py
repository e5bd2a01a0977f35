"""Engine scheduler policy, exercised with a fake model step (no tensors)."""

from __future__ import annotations

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.request import Request, RequestStatus
from llmfleet.engine.scheduler import Scheduler
from llmfleet.shared.core.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, max_seqs=8, budget=32, caching=True):
    bm = BlockManager(num_blocks, BS, caching)
    return bm, Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)


def req(rid, n_prompt, max_tokens=4, base=0):
    return Request(
        rid,
        [base + i for i in range(n_prompt)],
        SamplingParams(max_tokens=max_tokens),
        frozenset(),
        BS,
    )


def fake_step(sched: Scheduler):
    """Apply one schedule as the engine would, sampling token (num_tokens % 97)."""
    out = sched.schedule()
    for s in out.scheduled:
        r = s.request
        samples = s.samples
        r.num_computed_tokens += s.num_new_tokens
        sched.bm.cache_full_blocks(r)
        if samples:
            r.append_output(r.num_tokens % 97, None)
            if r.num_output_tokens >= r.params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
    return out


def test_decode_first_then_chunked_prefill_within_budget():
    bm, sched = make(budget=16)
    a = req("a", 6)
    sched.add(a)
    fake_step(sched)  # a prefills 6 tokens
    b = req("b", 40, base=1000)
    sched.add(b)
    out = fake_step(sched)
    sizes = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert sizes == {"a": 1, "b": 15}  # decode first, then a 15-token chunk of b
    assert out.num_batched_tokens == 16
    assert not any(s.samples for s in out.scheduled if s.request is b)
    out = fake_step(sched)
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"a": 1, "b": 15}


def test_max_num_seqs_caps_running():
    bm, sched = make(max_seqs=2)
    for i in range(3):
        sched.add(req(f"r{i}", 3, base=100 * i))
    out = fake_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_by_recompute_and_everything_freed():
    # 6 blocks: three requests of 8 prompt tokens + 8 outputs (4 blocks each) cannot coexist.
    bm, sched = make(num_blocks=6, budget=64)
    reqs = [req(f"r{i}", 8, max_tokens=8, base=100 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    preempted = 0
    for _ in range(200):
        if not sched.num_unfinished:
            break
        preempted += len(fake_step(sched).preempted)
    assert not sched.num_unfinished
    assert preempted > 0
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert bm.num_free_blocks == 6


def test_preempted_request_resumes_with_identical_tokens():
    def run(num_blocks):
        bm, sched = make(num_blocks=num_blocks, budget=64)
        reqs = [req(f"r{i}", 9, max_tokens=10, base=50 * i) for i in range(3)]
        for r in reqs:
            sched.add(r)
        n_pre = 0
        while sched.num_unfinished:
            n_pre += len(fake_step(sched).preempted)
        return [r.output_token_ids for r in reqs], n_pre

    small, n_small = run(num_blocks=8)
    big, n_big = run(num_blocks=64)
    assert n_small > 0 and n_big == 0
    assert small == big


def test_prefix_hit_sets_cached_tokens():
    bm, sched = make()
    a = req("a", 12, max_tokens=1)
    sched.add(a)
    while sched.num_unfinished:
        fake_step(sched)
    b = req("b", 14, max_tokens=1)  # same first 12 tokens
    sched.add(b)
    out = fake_step(sched)
    assert b.num_cached_tokens == 12
    assert out.scheduled[0].num_new_tokens == 2


def test_finish_while_waiting_frees_nothing_and_leaves_queue():
    bm, sched = make(max_seqs=1)
    a, b = req("a", 4), req("b", 4, base=10)
    sched.add(a)
    sched.add(b)
    fake_step(sched)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not sched.num_unfinished and bm.num_free_blocks == 64


def test_queued_prompt_tokens_leave_out_what_a_waiting_request_finds_cached():
    bm, sched = make(budget=64)
    a = req("a", 20)
    sched.add(a)
    assert sched.num_queued_prompt_tokens == 20
    fake_step(sched)  # a's prompt is computed; its 5 full blocks enter the prefix cache
    assert sched.num_queued_prompt_tokens == 0
    b = req("b", 30)  # shares a's first 20 tokens
    sched.add(b)
    assert b.num_cached_on_arrival == 20
    assert sched.num_queued_prompt_tokens == 10  # not 30: the cached prefix is not work
    fully = req("c", 20)  # wholly cached: its last token is still computed
    sched.add(fully)
    assert sched.num_queued_prompt_tokens == 11
