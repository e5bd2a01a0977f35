"""The worker's engine loop: the one place an `LLMEngine` is touched inside a running worker.

The engine is synchronous and not thread-safe. Everything that touches it, steps and every other
call (admission, abort, KV reads and writes, reservations, queued with `call`), runs on one
dedicated OS thread, the `EngineThread`, so the event loop keeps serving RPCs and sockets
meanwhile. Calls are applied *between* steps, in arrival order. Invariant: no engine method runs
while a step is in flight, and a call's effect is visible to the next step.

Why one thread, and never the event-loop thread: torch's CPU builds use GNU OpenMP, which gives
every thread that starts a parallel region a team of its own. Once a process has more OpenMP
threads than CPUs, libgomp cuts its spin-wait from 300,000 to 1,000 iterations, so the team's
threads sleep and wake (futex) around nearly every op, which multiplies the inter-token
latency. One thread for all torch work keeps one team.

The engine thread loops on its own: while there is work it steps back to back, applying the
ops queued meanwhile between steps; it never waits for the event loop. Right after each step,
still on the engine thread, the step's metrics are recorded and `on_step` gets its outputs, so
the worker pushes the new tokens before the event loop even wakes. After every iteration that
did something (ops applied and/or a step run), `collect` reads, still on the engine thread,
what the event loop will need of the engine as it was then (KV events, load, running requests);
the iteration (outputs, empty when no step ran, and that reading) is queued to `on_iteration`,
which handles the iterations in order on the event loop (KV events, spans, prefill waiters,
request metrics) while the next steps run. Event-loop code reads the engine only through ops
or these readings. With no work and no queued op the thread waits on an event (no polling).

A step that raises is a failed forward pass: the engine's state is no longer to be trusted, so
the loop steps no more and sends nothing (no request ends "successfully" with tokens missing);
`on_failure(error)` runs on the event loop, once, and the worker hands its requests back (see
runtime.py). Ops still apply (cancels, stats); the loop counts as idle from then on.

On CPU, a step takes every core; after a step that gave a request its first token the loop
waits `first_token_yield_s` before the next one, so the router and tokenizer processes that
carry the token to the client run at once instead of waiting to preempt the step.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.request import RequestOutput
from llmfleet.services.worker.outputs import StepMetrics
from llmfleet.shared.wire.service import cancel_and_wait

logger = logging.getLogger(__name__)

T = TypeVar("T")
OnIteration = Callable[[int, list[RequestOutput], Any], Awaitable[None]]
OnStep = Callable[[int, list[RequestOutput]], None]
OnFailure = Callable[[BaseException], None]
Collect = Callable[[int, list[RequestOutput]], Any]
Op = tuple[Callable[[], Any], "asyncio.Future[Any] | None"]
Iteration = tuple[int, list[RequestOutput], Any]  # step, its outputs, what `collect` returned


class EngineThread:
    """The one OS thread on which a worker process does torch work (see the module docstring).

    `run` awaits `fn(*args)` executed there, in the caller's context (so the current span is
    the caller's). Model loading and engine construction go through it too."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.ident: int | None = None  # the thread's id (set below, before any work)
        self._executor.submit(self._remember_ident).result()

    def _remember_ident(self) -> None:
        self.ident = threading.get_ident()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args, **kwargs)
        return asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await self.submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        """Stop accepting work; a call in flight finishes on the thread."""
        self._executor.shutdown(wait=False)


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_iteration: OnIteration,
        thread: EngineThread,
        *,
        first_token_yield_s: float = 0.0,
        on_step: OnStep | None = None,
        collect: Collect | None = None,
        on_failure: OnFailure | None = None,
        fault_inject_step: int = 0,
    ) -> None:
        """`thread`: the worker's EngineThread (it built `engine`; its owner shuts it down).
        `on_step(step, outputs)`: called on the engine thread after each step that produced
        outputs; it must not block (errors are logged, the loop goes on).
        `collect(step, outputs)`: called on the engine thread after every iteration that did
        something; what it returns (what `on_iteration` needs to know of the engine as it was
        then) is passed to `on_iteration(step, outputs, collected)` on the event loop.
        `first_token_yield_s`: after a step that gave a request its first token, start the next
        step this much later, unless requests wait (see WorkerConfig.first_token_yield_ms).
        `on_failure(error)`: called on the event loop, once, when a step raised (see above) or
        the engine thread's loop itself failed.
        `fault_inject_step`: tests only; every step from this one on raises (0: off)."""
        self.engine = engine
        self.first_token_yield_s = first_token_yield_s
        self.thread = thread
        self._on_iteration = on_iteration
        self._on_step = on_step
        self._collect = collect
        self._on_failure = on_failure
        self.fault_inject_step = fault_inject_step
        self.failure: BaseException | None = None  # the step error that stopped the loop
        self._thread_error: BaseException | None = None  # the engine thread's loop died of it
        self._ops: deque[Op] = deque()  # appended on the event loop, taken on the engine thread
        self._applying = False  # the engine thread took ops it has not applied yet
        self._wake = threading.Event()
        self._stopping = False
        self._idle = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[None] | None = None  # the engine thread's loop
        self._iterations: asyncio.Queue[Iteration] = asyncio.Queue()
        self._deliver: asyncio.Task[None] | None = None
        self.num_steps = 0  # written on the engine thread
        self.step_started_ns = 0  # wall clock (ns) at the start of the latest step (for spans)
        self._metrics = StepMetrics(engine)
        self.step_model = self._metrics.step_model  # updated on the engine thread

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._deliver = asyncio.create_task(self._deliver_iterations(), name="engine-iterations")
        self._done = self.thread.submit(self._run)
        self._done.add_done_callback(self._thread_ended)

    async def stop(self) -> None:
        """Stop looping (a step in flight finishes on its thread; nothing runs after it), then
        hand the iterations already done to `on_iteration` and close the engine (the other
        ranks of a tensor-parallel engine exit)."""
        self._stopping = True
        self._wake.set()
        if self._done is not None:
            await asyncio.wait([self._done], timeout=_STOP_WAIT_S)
            self._done = None
        if self._deliver is not None:
            self._iterations.put_nowait(_END)
            await asyncio.wait([self._deliver], timeout=_STOP_WAIT_S)
            await cancel_and_wait(self._deliver)
            self._deliver = None
        await asyncio.wait([self.thread.submit(self.engine.close)], timeout=_STOP_WAIT_S)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` between steps and return its result (or raise its error).

        The op is applied even if the awaiting task is cancelled meanwhile, so cleanup calls
        (releases, aborts) issued from cancelled RPCs still take effect.
        """
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Queue `fn` now (it runs before the next step) and return the future of its result."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._enqueue(fut, fn, args, kwargs)
        return fut

    def call_soon(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue `fn` without waiting for it (errors are logged)."""
        self._enqueue(None, fn, args, kwargs)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """From an op, on the engine thread: run `fn(*args)` on the event loop, before the
        op's caller resumes and before the next step's outputs reach `on_iteration`."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def _enqueue(
        self, fut: asyncio.Future[Any] | None, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        if self._thread_error is not None:  # no thread is left to apply it
            if fut is not None:
                fut.set_exception(RuntimeError(f"the engine thread failed: {self._thread_error}"))
            return
        ctx = contextvars.copy_context()  # the caller's (its span), not the loop task's
        self._ops.append((functools.partial(ctx.run, fn, *args, **kwargs), fut))
        self._idle.clear()
        self._wake.set()

    @property
    def idle(self) -> bool:
        return not self._ops and not self._applying and not self._has_work()

    def _has_work(self) -> bool:
        """Requests to step (none once a step failed: nothing is stepped again)."""
        return self.failure is None and self.engine.has_unfinished()

    async def wait_idle(self) -> None:
        """Wait until no request is unfinished and no op is queued."""
        while not self.idle:
            await self._idle.wait()

    def _iterate(
        self, ops: list[Op], loop: asyncio.AbstractEventLoop
    ) -> tuple[list[RequestOutput], float | None]:
        """On the engine thread: apply `ops`, hand their results to the event loop at once,
        then run one step if anything is unfinished. Returns (outputs, step seconds or None)."""
        if ops:
            results = _apply(ops)
            loop.call_soon_threadsafe(_settle, ops, results)
        self._applying = False
        if not self._has_work():
            return [], None
        started = time.perf_counter()
        self.step_started_ns = time.time_ns()
        try:
            step = self.num_steps + 1
            if self.fault_inject_step and step >= self.fault_inject_step:
                raise InjectedFault(f"fault injected at engine step {step} (--fault-inject-step)")
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed: this worker steps no more")
            self.failure = exc
            if self._on_failure is not None:
                _post(loop, self._on_failure, exc)
            return [], None
        seconds = time.perf_counter() - started
        # Recorded before the tokens leave, so a client that saw a step's tokens also finds
        # the step in the metrics (and the engine's counters are read on their own thread).
        self._metrics.on_step(seconds, self.engine.last_step_cost, self.engine.last_step_work)
        if outputs and self._on_step is not None:
            try:
                self._on_step(self.num_steps + 1, outputs)  # the number this step gets
            except Exception:
                logger.exception("on_step for step %d failed", self.num_steps + 1)
        return outputs, seconds

    def _run(self) -> None:
        """The engine thread's loop: steps back to back while there is work, the ops queued
        meanwhile applied between them; the event loop is only told (never waited for)."""
        loop = self._loop
        assert loop is not None
        engine = self.engine
        if engine.device.type == "cuda":  # this thread's kernels go to the engine's GPU
            torch.cuda.set_device(engine.device)
        while not self._stopping:
            self._wake.clear()  # ops queued from here on set it again
            ops: list[Op] = []
            if self._ops:
                self._applying = True
                while self._ops:
                    ops.append(self._ops.popleft())
            outputs, seconds = self._iterate(ops, loop)
            if seconds is not None:
                self.num_steps += 1
            if ops or seconds is not None:
                collected = None
                if self._collect is not None:
                    try:
                        collected = self._collect(self.num_steps, outputs)
                    except Exception:
                        logger.exception("collecting step %d failed", self.num_steps)
                item = (self.num_steps, outputs, collected)
                if not _post(loop, self._iterations.put_nowait, item):
                    return
            if self.first_token_yield_s and _gave_first_token(outputs):
                # The token is on its way (sent above); leave the cores to the processes
                # carrying it unless a queued request needs the next step.
                if self._has_work() and not engine.num_waiting:
                    self._wake.wait(self.first_token_yield_s)
            if not self._ops and not self._has_work():
                if not _post(loop, self._set_idle):
                    return
                self._wake.wait()

    def _set_idle(self) -> None:
        if self.idle:
            self._idle.set()

    async def _deliver_iterations(self) -> None:
        """On the event loop: each iteration's outputs to `on_iteration`, in order."""
        while True:
            item = await self._iterations.get()
            if item is _END:
                return
            step, outputs, collected = item
            try:
                await self._on_iteration(step, outputs, collected)
            except Exception:
                logger.exception("handling step %d outputs failed", step)

    def _thread_ended(self, done: asyncio.Future[None]) -> None:
        """The engine thread's loop ended: by `stop`, or failing (not an op, not a step):
        then fail every op still queued, and the worker as a failed step would."""
        if done.cancelled() or done.exception() is None:
            return
        exc = done.exception()
        self._thread_error = exc
        logger.error("the engine loop failed", exc_info=exc)
        ops = list(self._ops)
        self._ops.clear()
        _settle(ops, [(False, exc)] * len(ops))
        if self.failure is None:  # a worker whose engine steps no more is a failed worker
            self.failure = exc
            if self._on_failure is not None:
                self._on_failure(exc)


class InjectedFault(RuntimeError):
    """A forward-pass failure injected for tests (WorkerConfig.fault_inject_step)."""


_STOP_WAIT_S = 5.0
_END: Any = object()


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """`fn(*args)` on the event loop; False when the loop is closed (the process is ending)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _settle(ops: list[Op], results: list[tuple[bool, Any]]) -> None:
    """On the event loop: hand each op's result or error to its caller (once)."""
    for (_, fut), (ok, value) in zip(ops, results, strict=True):
        if fut is None:
            if not ok:
                logger.error("engine op failed", exc_info=value)
        elif not fut.done():
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)


def _gave_first_token(outputs: list[RequestOutput]) -> bool:
    return any(o.new_token_ids and o.num_output_tokens == len(o.new_token_ids) for o in outputs)


def _apply(ops: list[Op]) -> list[tuple[bool, Any]]:
    """Run ops in order (on the engine thread); (True, result) or (False, exception) each."""
    results: list[tuple[bool, Any]] = []
    for fn, _ in ops:
        try:
            results.append((True, fn()))
        except Exception as e:  # handed to the caller, who maps it to a status
            results.append((False, e))
    return results
