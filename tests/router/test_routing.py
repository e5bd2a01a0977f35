"""Routing policies: round robin, least load, prefix aware balanced against load."""

from __future__ import annotations

import pytest

from llmfleet.services.router.routing import (
    OUTCOME_LOAD_FALLBACK,
    OUTCOME_NO_PREFIX,
    OUTCOME_PREFIX_HIT,
    Candidate,
    LeastLoad,
    PrefixAware,
    RoundRobin,
    make_policy,
)


def test_round_robin_alternates_and_survives_membership_changes():
    rr = RoundRobin()
    cands = [Candidate("b", 0), Candidate("a", 0)]
    picks = [rr.choose(cands, 16).worker_id for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]
    cands.append(Candidate("c", 0))
    assert rr.choose(cands, 16).worker_id == "c"
    assert rr.choose([Candidate("a", 0)], 16).worker_id == "a"


def test_least_load_then_free_blocks():
    ll = LeastLoad()
    d = ll.choose([Candidate("a", 3, 10), Candidate("b", 1, 5), Candidate("c", 1, 50)], 16)
    assert d.worker_id == "c" and d.policy == "least_load"


def test_prefix_aware_prefers_longest_prefix():
    pa = PrefixAware(load_threshold=4)
    d = pa.choose([Candidate("a", 0, 10, 0), Candidate("b", 3, 10, 5)], 16)
    assert (d.worker_id, d.outcome, d.matched_prefix_tokens) == ("b", OUTCOME_PREFIX_HIT, 80)


def test_prefix_aware_falls_back_to_load_beyond_threshold():
    pa = PrefixAware(load_threshold=4)
    d = pa.choose([Candidate("a", 1, 10, 0), Candidate("b", 6, 10, 5)], 16)
    assert (d.worker_id, d.outcome, d.matched_prefix_tokens) == ("a", OUTCOME_LOAD_FALLBACK, 0)
    d = pa.choose([Candidate("a", 1, 10, 0), Candidate("b", 5, 10, 5)], 16)  # exactly at it
    assert d.worker_id == "b"


def test_prefix_aware_ties_go_to_lower_load_and_no_prefix_to_least_load():
    pa = PrefixAware(load_threshold=4)
    d = pa.choose([Candidate("a", 2, 0, 3), Candidate("b", 1, 0, 3)], 16)
    assert d.worker_id == "b" and d.outcome == OUTCOME_PREFIX_HIT
    d = pa.choose([Candidate("a", 2, 0, 0), Candidate("b", 1, 0, 0)], 16)
    assert d.worker_id == "b" and d.outcome == OUTCOME_NO_PREFIX


def test_make_policy_and_empty():
    assert make_policy("prefix_aware", 2).needs_prefix
    assert not make_policy("round_robin").needs_prefix
    with pytest.raises(ValueError):
        make_policy("random")
    with pytest.raises(ValueError):
        LeastLoad().choose([], 16)
