"""The predicted-TTFT routing scorer and the step-time model that feeds it (pure Python)."""

from __future__ import annotations

import dataclasses

import pytest

from llmfleet.services.router.routing import (
    OUTCOME_PREDICTED,
    Candidate,
    PredictedTTFT,
    imposed_delay,
    make_policy,
    predict_ttft,
    uncached_tokens,
    with_peer_costs,
)
from llmfleet.shared.core.step_model import DEFAULT_STEP_S, StepTimeModel

BS = 16


def cand(wid: str, **kw: object) -> Candidate:
    base = {"num_requests": 0, "num_free_blocks": 1000, "num_total_blocks": 1000}
    base.update(step_s=0.02, prefill_s_per_token=1e-4, fetch_s_per_token=1e-5)
    base.update(kw)
    return Candidate(wid, **base)  # type: ignore[arg-type]


def test_prediction_adds_queue_compute_fetch_and_pressure():
    # 1024-token prompt, 32 blocks cached locally, 16 more in the kvstore, 100 tokens queued.
    c = cand("w", prefix_blocks=32, store_blocks=48, queued_prompt_tokens=100)
    assert predict_ttft(c, BS, 1024) == pytest.approx(0.02 + (100 + 256) * 1e-4 + 256 * 1e-5)
    # Short of memory: the missing blocks' share of the cache, times 256 steps.
    tight = cand("w", num_free_blocks=40, num_total_blocks=100)
    assert predict_ttft(tight, BS, 1024) == pytest.approx(
        0.02 + 1024 * 1e-4 + (64 - 40) / 100 * 256 * 0.02
    )
    # A fully cached prompt still computes its last token.
    assert predict_ttft(cand("w", prefix_blocks=64), BS, 1024) == pytest.approx(0.02 + 1e-4)


def test_the_idle_worker_that_fetches_from_the_kvstore_beats_the_busy_one_holding_the_prefix():
    busy = cand("a", prefix_blocks=60, num_requests=12, queued_prompt_tokens=6000)
    idle = cand("b", store_blocks=60, num_requests=0)
    decision = PredictedTTFT().choose([busy, idle], BS, 1000)
    assert decision.worker_id == "b" and decision.outcome == OUTCOME_PREDICTED
    assert decision.predicted_ttft_s == pytest.approx(predict_ttft(idle, BS, 1000))
    # Without the kvstore the idle worker recomputes the prompt, and still wins here...
    assert PredictedTTFT().choose([busy, cand("b")], BS, 1000).worker_id == "b"
    # ...but not against a short queue: then the cached prefix is worth the wait.
    short = cand("a", prefix_blocks=60, num_requests=2, queued_prompt_tokens=200)
    assert PredictedTTFT().choose([short, cand("b")], BS, 1000).worker_id == "a"


def test_ties_spread_to_the_least_loaded():
    same = [cand(w, num_requests=n) for w, n in (("a", 5), ("b", 1), ("c", 3))]
    assert PredictedTTFT().choose(same, BS, 100).worker_id == "b"
    # Different coefficients: the faster worker wins though it is busier.
    fast = Candidate("f", 4, 1000, 0, 1000, 0, 0, 0.01, 5e-5)
    slow = Candidate("s", 0, 1000, 0, 1000, 0, 0, 0.04, 2e-4)
    assert PredictedTTFT().choose([slow, fast], BS, 2000).worker_id == "f"
    assert make_policy("predicted_ttft").name == "predicted_ttft"
    with pytest.raises(ValueError):
        PredictedTTFT().choose([], BS, 10)


def test_step_model_learns_step_and_prefill_cost_and_follows_drift():
    m = StepTimeModel(step_s=1.0, prefill_s_per_token=1.0)  # priors far off
    for _ in range(50):
        m.observe(0.010, prefill_tokens=0, decode_seqs=32)
        m.observe(0.010 + 2048 * 5e-5, prefill_tokens=2048, decode_seqs=32)
    assert m.step_s == pytest.approx(0.010, rel=1e-3)
    assert m.prefill_s_per_token == pytest.approx(5e-5, rel=1e-2)
    assert m.predict(1000) == pytest.approx(0.010 + 1000 * 5e-5, rel=1e-2)
    for _ in range(60):  # the GPU gets busier: decode steps double
        m.observe(0.020, prefill_tokens=0, decode_seqs=32)
    assert m.step_s == pytest.approx(0.020, rel=0.01)
    before = (m.step_s, m.num_decode_steps, m.num_prefill_steps)
    m.observe(0.5, prefill_tokens=0, decode_seqs=0)  # an empty step teaches nothing
    assert (m.step_s, m.num_decode_steps, m.num_prefill_steps) == before
    with pytest.raises(ValueError):
        m.observe(-1.0, prefill_tokens=0, decode_seqs=1)
    with pytest.raises(ValueError):
        StepTimeModel(weight=0)


def test_router_flags_for_the_policy_and_the_store_view():
    from llmfleet.services.router.__main__ import SERVICE
    from llmfleet.shared.core.config import RouterConfig
    from llmfleet.shared.core.errors import ValidationError

    argv = ["--routing-policy", "predicted_ttft", "--kvstore", "127.0.0.1:1"]
    cfg = SERVICE.parse([*argv, "--kvstore-events", "tcp://127.0.0.1:2"])[0]
    assert (cfg.routing_policy, cfg.kvstore_address, cfg.kvstore_events_endpoint) == (
        "predicted_ttft",
        "127.0.0.1:1",
        "tcp://127.0.0.1:2",
    )
    with pytest.raises(ValidationError) as err:
        RouterConfig(kvstore_address="127.0.0.1:1")  # a view needs the events too
    assert err.value.field == "kvstore_events_endpoint"


def test_step_model_learns_the_cost_of_each_decoded_sequence():
    """A CPU's decode step grows with its batch: the regression finds base and slope, and a
    prefill step is charged only what it took beyond the decode part."""
    m = StepTimeModel()
    for i in range(200):
        seqs = 1 + i % 8
        m.observe(0.005 + 0.003 * seqs, prefill_tokens=0, decode_seqs=seqs)
    assert m.step_s == pytest.approx(0.005, rel=0.05)
    assert m.step_s_per_seq == pytest.approx(0.003, rel=0.05)
    for _ in range(30):
        m.observe(0.005 + 0.003 * 4 + 100 * 1e-3, prefill_tokens=100, decode_seqs=4)
    assert m.prefill_s_per_token == pytest.approx(1e-3, rel=0.05)
    assert m.predict(50, 2) == pytest.approx(0.005 + 0.006 + 0.05, rel=0.05)
    # The busier of two otherwise equal workers now predicts later.
    busy = cand("busy", num_requests=6, step_s_per_seq=0.003)
    idle = cand("idle", num_requests=0, step_s_per_seq=0.003)
    assert predict_ttft(busy, BS, 64) - predict_ttft(idle, BS, 64) == pytest.approx(6 * 0.003)


def test_decode_headroom_picks_the_faster_batch_with_room_for_the_prompt():
    from llmfleet.services.router.routing import DecodeHeadroom, predict_decode_step

    busy = cand("busy", num_requests=40, step_s_per_seq=1e-3)
    light = cand("light", num_requests=4, step_s_per_seq=1e-3)
    assert DecodeHeadroom().choose([busy, light], BS, 512).worker_id == "light"
    # The lighter batch lacks room for the prompt's 32 blocks: waiting for memory costs more.
    full = cand("light", num_requests=4, step_s_per_seq=1e-3, num_free_blocks=8)
    assert predict_decode_step(full, BS, 512) == pytest.approx(
        512 * 1e-5 + 0.02 + 5e-3 + (32 - 8) / 1000 * 256 * 0.02
    )
    assert DecodeHeadroom().choose([busy, full], BS, 512).worker_id == "busy"
    same = [cand("a", num_requests=3), cand("b", num_requests=1)]
    assert DecodeHeadroom().choose(same, BS, 64).worker_id == "b"  # a tie: the lighter


def test_decode_headroom_avoids_a_worker_whose_link_is_busy_with_pushes():
    """The first token waits for the prompt's KV to arrive: KV already leased and on its way
    to a decode worker is pushed first, so an equal worker with an idle link wins."""
    from llmfleet.services.router.routing import DecodeHeadroom, predict_decode_step

    pushed_to = cand("a", num_requests=2, incoming_kv_tokens=20_000)
    idle_link = cand("b", num_requests=6)
    assert predict_decode_step(pushed_to, BS, 4000) == pytest.approx(24_000 * 1e-5 + 0.02)
    assert DecodeHeadroom().choose([pushed_to, idle_link], BS, 4000).worker_id == "b"


def test_a_fetch_waits_for_the_fetches_routed_before_it():
    """Fetches into one worker go one after another: with 60K tokens on their way to `a`,
    the worker with an idle link wins the kvstore fetch. A prompt fetched from nowhere does
    not wait for the link."""
    busy_link = cand("a", store_blocks=256, incoming_kv_tokens=60_000)
    idle_link = cand("b", store_blocks=256, queued_prompt_tokens=2000, num_queued=2)
    assert predict_ttft(busy_link, BS, 4096) == pytest.approx(0.02 + 1e-4 + (60_000 + 4096) * 1e-5)
    assert PredictedTTFT().choose([busy_link, idle_link], BS, 4096).worker_id == "b"
    local = cand("a", prefix_blocks=256, incoming_kv_tokens=60_000)
    assert predict_ttft(local, BS, 4096) == pytest.approx(0.02 + 1e-4)


def test_under_load_a_request_stays_with_its_prefix_rather_than_recompute_it_elsewhere():
    """The cost adds the delay a prompt's compute puts on the requests queued behind it: a
    shorter queue elsewhere does not pay for recomputing 1000 tokens in front of 8 others."""
    holder = cand("a", prefix_blocks=60, queued_prompt_tokens=3000, num_queued=8)
    other = cand("b", queued_prompt_tokens=1500, num_queued=8)
    assert predict_ttft(other, BS, 1000) < predict_ttft(holder, BS, 1000)  # greedy: b
    decision = PredictedTTFT().choose([holder, other], BS, 1000)
    assert decision.worker_id == "a"
    assert decision.predicted_ttft_s == pytest.approx(predict_ttft(holder, BS, 1000))
    assert dict(decision.predictions) == pytest.approx(
        {"a": predict_ttft(holder, BS, 1000), "b": predict_ttft(other, BS, 1000)}
    )
    # With nobody queued behind either, the request's own TTFT decides.
    idle = [cand("a", prefix_blocks=60, queued_prompt_tokens=3000), cand("b")]
    assert PredictedTTFT().choose(idle, BS, 1000).worker_id == "b"
    assert imposed_delay(holder, BS, 1000, 0.0) == pytest.approx(40 * 1e-4 * 8)


def test_the_arrival_rate_weighs_the_compute_that_later_requests_queue_behind():
    now = [0.0]
    policy = PredictedTTFT(clock=lambda: now[0])
    # The holder's queue is unseen by the router's counts (num_queued 0): only the rate tells.
    holder = cand("a", prefix_blocks=60, queued_prompt_tokens=2000)
    spare = cand("b")
    assert policy.choose([holder, spare], BS, 1000).worker_id == "b"  # a trickle: TTFT
    for _ in range(200):  # 100 requests a second
        now[0] += 0.01
        policy.choose([holder, spare], BS, 1000)
    assert policy.arrival_rate == pytest.approx(100, rel=0.01)
    # 50 a second per worker arrive during b's 0.1 s recompute, 0.05 s later each on average.
    assert imposed_delay(spare, BS, 1000, 50) == pytest.approx(0.1 * 50 * 0.1 / 2)
    assert policy.choose([holder, spare], BS, 1000).worker_id == "a"


def test_a_deep_queue_takes_a_step_per_token_budget_each_decoding_the_batch():
    c = cand("w", num_requests=10, queued_prompt_tokens=5000, step_token_budget=1000)
    # 6000 prompt tokens at 990 a step (10 decoded beside them): 7 steps.
    assert predict_ttft(c, BS, 1000) == pytest.approx(7 * 0.02 + 6000 * 1e-4)
    assert predict_ttft(dataclasses.replace(c, step_token_budget=0), BS, 1000) == pytest.approx(
        0.02 + 6000 * 1e-4
    )


def test_uncached_tokens_are_neither_cached_there_nor_in_the_kvstore():
    c = cand("w", prefix_blocks=32, store_blocks=48)
    assert uncached_tokens(c, BS, 1024) == 1024 - 48 * BS
    assert uncached_tokens(cand("w", prefix_blocks=64), BS, 1024) == 1  # its last token


def test_a_sessions_worker_wins_ties_but_not_the_prediction():
    home = cand("a", num_requests=6, affinity=True)
    assert PredictedTTFT().choose([home, cand("b", num_requests=1)], BS, 100).worker_id == "a"
    far = cand("a", num_requests=6, affinity=True, queued_prompt_tokens=4000)
    assert PredictedTTFT().choose([far, cand("b", num_requests=1)], BS, 100).worker_id == "b"


def test_a_worker_that_has_not_measured_is_scored_with_its_peers_costs():
    """Unmeasured costs (0) take the measured peers' mean, not the prior: on a CPU the prior
    prefill cost is 20x too low, which sent every request to the new worker."""
    measured = cand("a", prefill_s_per_token=2e-3, step_s=0.07, step_s_per_seq=0.01)
    new = Candidate("b", 0, 1000, 0, 1000, step_s=0, prefill_s_per_token=0, fetch_s_per_token=0)
    filled = {c.worker_id: c for c in with_peer_costs([measured, new])}
    assert (filled["b"].step_s, filled["b"].step_s_per_seq) == (0.07, 0.01)
    assert filled["b"].prefill_s_per_token == 2e-3 and filled["b"].fetch_s_per_token == 1e-5
    assert filled["a"] is measured
    # Nobody measured: the priors.
    [alone] = with_peer_costs([new])
    assert (alone.step_s, alone.prefill_s_per_token) == (DEFAULT_STEP_S, 1e-4)
    # So equal queues are a tie (to the less loaded), not a rush to the unmeasured worker.
    busy_new = dataclasses.replace(new, num_requests=3, queued_prompt_tokens=1000)
    busy_old = dataclasses.replace(measured, num_requests=1, queued_prompt_tokens=1000)
    assert PredictedTTFT().choose([busy_old, busy_new], BS, 300).worker_id == "a"


def test_prompt_steps_before_the_first_decode_step_are_forgotten_once_the_base_is_known():
    m = StepTimeModel()
    for _ in range(5):  # a 70 ms base, all charged to 16 prompt tokens: 4.4 ms a token
        m.observe(0.070 + 16 * 1.8e-3, prefill_tokens=16, decode_seqs=0)
    assert m.prefill_s_per_token == pytest.approx(0.0988 / 16)
    m.observe(0.070, prefill_tokens=0, decode_seqs=1)
    assert m.num_prefill_steps == 0  # reported as not measured until the next prompt step
    m.observe(0.070 + 100 * 1.8e-3, prefill_tokens=100, decode_seqs=0)
    assert m.prefill_s_per_token == pytest.approx(1.8e-3, rel=0.05)
