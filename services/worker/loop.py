"""The worker's engine loop: the one place an `LLMEngine` is touched inside a running worker.

The engine is synchronous and not thread-safe. Its steps run on a worker thread
(`asyncio.to_thread`), so the event loop keeps serving RPCs and sockets meanwhile; every other
engine call (admission, abort, KV reads and writes, reservations) is queued with `call` and
applied on the event-loop thread *between* steps, in arrival order. Invariant: no engine method
runs while a step is in flight, and a call's effect is visible to the next step.

After every iteration that did something (ops applied and/or a step run), `on_iteration` gets
the step's outputs (empty when no step ran), so the worker can push tokens and publish KV
events. With no work and no queued op the loop waits on an event (no polling).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from llmfleet.services.worker.engine.engine import LLMEngine, RequestOutput
from llmfleet.services.worker.outputs import StepMetrics
from llmfleet.shared.service import cancel_and_wait

logger = logging.getLogger(__name__)

T = TypeVar("T")
OnIteration = Callable[[int, list[RequestOutput]], Awaitable[None]]


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_iteration: OnIteration) -> None:
        self.engine = engine
        self._on_iteration = on_iteration
        self._ops: deque[tuple[Callable[[], Any], asyncio.Future[Any] | None]] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_steps = 0
        self.step_started_ns = 0  # wall clock (ns) at the start of the latest step (for spans)
        self._metrics = StepMetrics(engine)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Stop looping (a step in flight finishes on its thread; nothing runs after it)."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` between steps and return its result (or raise its error).

        The op is applied even if the awaiting task is cancelled meanwhile, so cleanup calls
        (releases, aborts) issued from cancelled RPCs still take effect.
        """
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._ops.append((lambda: fn(*args, **kwargs), fut))
        self._idle.clear()
        self._wake.set()
        return await fut

    def call_soon(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue `fn` without waiting for it (errors are logged)."""
        self._ops.append((lambda: fn(*args, **kwargs), None))
        self._idle.clear()
        self._wake.set()

    @property
    def idle(self) -> bool:
        return not self._ops and not self.engine.has_unfinished()

    async def wait_idle(self) -> None:
        """Wait until no request is unfinished and no op is queued."""
        while not self.idle:
            await self._idle.wait()

    def _apply_ops(self) -> bool:
        did = bool(self._ops)
        while self._ops:
            fn, fut = self._ops.popleft()
            try:
                result = fn()
            except Exception as e:  # handed to the caller, who maps it to a status
                if fut is None:
                    logger.exception("engine op failed")
                elif not fut.done():
                    fut.set_exception(e)
            else:
                if fut is not None and not fut.done():
                    fut.set_result(result)
        return did

    async def _run(self) -> None:
        while True:
            did_ops = self._apply_ops()
            outputs: list[RequestOutput] = []
            stepped = False
            if self.engine.has_unfinished():
                started = time.perf_counter()
                self.step_started_ns = time.time_ns()
                try:
                    outputs = await asyncio.to_thread(self.engine.step)
                except Exception:
                    logger.exception("engine step failed; aborting every request")
                    for rid in self.engine.request_ids():
                        self.engine.abort(rid)
                else:
                    self.num_steps += 1
                    stepped = True
                    self._metrics.on_step(time.perf_counter() - started, self.engine.last_step_cost)
            if did_ops or stepped:
                try:
                    await self._on_iteration(self.num_steps, outputs)
                except Exception:
                    logger.exception("handling step %d outputs failed", self.num_steps)
            if not self._ops and not self.engine.has_unfinished():
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
