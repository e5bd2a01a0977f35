"""A worker's engine thread that fails outside a step (say, it cannot select its GPU) fails
the worker like a failed step: the failure is recorded, `on_failure` runs once, and ops queued
or sent later raise instead of waiting forever."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import sim_checkpoint

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_simulated
from llmfleet.services.worker.loop import EngineLoop, EngineThread
from llmfleet.shared.core.config import EngineConfig


def test_an_engine_thread_failing_outside_a_step_fails_the_worker(monkeypatch) -> None:
    engine = LLMEngine(EngineConfig(simulate=True, sim_step_ms=0), load_simulated(sim_checkpoint()))

    def lost() -> bool:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "has_unfinished", lost)

    async def main() -> tuple[list[BaseException], BaseException | None]:
        failures: list[BaseException] = []
        thread = EngineThread()

        async def on_iteration(*_: object) -> None:
            return None

        loop = EngineLoop(engine, on_iteration, thread, on_failure=failures.append)
        loop.start()
        deadline = asyncio.get_running_loop().time() + 30
        while not failures and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="device lost"):
            await asyncio.wait_for(loop.call(lambda: 1), 10)
        thread.shutdown()
        return failures, loop.failure

    failures, failure = asyncio.run(main())
    assert len(failures) == 1 and failures[0] is failure
    assert str(failure) == "device lost"
