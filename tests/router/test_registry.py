"""Worker table: registration, liveness by heartbeat, re-registration."""

from __future__ import annotations

import dataclasses

import pytest

from llmfleet.services.router.registry import Load, WorkerRegistry
from llmfleet.shared.core.model_info import ModelInfo

MODEL = ModelInfo(
    model_id="m",
    architecture="LlamaForCausalLM",
    vocab_size=300,
    max_model_len=128,
    eos_token_ids=(),
    max_n=16,
    max_logprobs=20,
    block_size=4,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _reg(clock: Clock) -> WorkerRegistry:
    return WorkerRegistry(heartbeat_timeout_ms=3000, clock=clock)


def test_register_then_live_and_known():
    clock = Clock()
    reg = _reg(clock)
    r = reg.register("w1", "unified", "h:1", "tcp://h:2", MODEL)
    assert r.is_new and r.address_changed and r.events_changed
    assert [w.worker_id for w in reg.live()] == ["w1"]
    assert reg.heartbeat("w1", Load(num_running=3))
    assert reg.get("w1").load.num_requests == 3
    assert not reg.heartbeat("nobody", None)


def test_silent_worker_gets_no_traffic_and_late_joiner_does():
    clock = Clock()
    reg = _reg(clock)
    reg.register("a", "unified", "h:1", "tcp://h:2", MODEL)
    clock.t += 2.0
    reg.register("b", "unified", "h:3", "tcp://h:4", MODEL)
    clock.t += 1.5  # a: 3.5 s silent, b: 1.5 s
    assert [w.worker_id for w in reg.live()] == ["b"]
    assert [w.worker_id for w in reg.expired()] == ["a"]
    assert not reg.is_live("a") and reg.is_live("b")
    assert reg.heartbeat("a", None)  # a comes back
    assert {w.worker_id for w in reg.live()} == {"a", "b"}


def test_reregistration_updates_entry():
    clock = Clock()
    reg = _reg(clock)
    reg.register("w", "decode", "h:1", "tcp://h:2", MODEL)
    r = reg.register("w", "decode", "h:9", "tcp://h:2", MODEL, Load(num_waiting=2))
    assert not r.is_new and r.address_changed and not r.events_changed
    assert reg.get("w").address == "h:9" and reg.get("w").load.num_waiting == 2
    assert len(reg.all()) == 1


def test_removed_worker_is_unknown_to_heartbeats():
    reg = _reg(Clock())
    reg.register("w", "unified", "h:1", "tcp://h:2", MODEL)
    assert reg.remove("w") is not None
    assert not reg.heartbeat("w", None)
    assert reg.live() == []


def test_roles_and_model_limits():
    reg = _reg(Clock())
    reg.register("p", "prefill", "h:1", "", MODEL)
    reg.register("d", "decode", "h:2", "", dataclasses.replace(MODEL, max_model_len=64, max_n=2))
    assert [w.worker_id for w in reg.live("decode")] == ["d"]
    m = reg.model()
    assert m.max_model_len == 64 and m.max_n == 2 and m.block_size == 4
    assert reg.model(("unified",)) is None
    with pytest.raises(ValueError):
        reg.register("x", "bogus", "h:3", "", MODEL)


def test_streamed_outputs_keep_a_worker_with_late_heartbeats_alive():
    clock = Clock()
    reg = _reg(clock)
    reg.register("a", "unified", "h:1", "tcp://h:2", MODEL)
    for _ in range(4):  # no heartbeat for 8 s, but tokens arrive every 2 s
        clock.t += 2.0
        reg.touch("a")
    assert [w.worker_id for w in reg.live()] == ["a"] and not reg.expired()
    reg.touch("nobody")  # outputs of a removed worker do not bring it back
    assert reg.get("nobody") is None


def test_draining_worker_takes_no_new_requests_but_stays_known():
    clock = Clock()
    reg = _reg(clock)
    reg.register("a", "unified", "h:1", "tcp://h:2", MODEL)
    reg.register("b", "unified", "h:3", "tcp://h:4", MODEL)
    assert reg.set_draining("a") and not reg.set_draining("nobody")
    assert [w.worker_id for w in reg.live()] == ["b"] and reg.taking("unified")
    assert reg.heartbeat("a", None) and not reg.expired()
    reg.set_draining("b")  # the whole fleet stops: the draining ones still take requests
    assert [w.worker_id for w in reg.live()] == ["a", "b"] and not reg.taking("unified")
