"""Launch-time helpers shared by the Triton kernel modules.

Triton decides between compiling a kernel and interpreting it on the CPU when `@triton.jit`
runs (`triton.knobs.runtime.interpret`, read in the decorator; checked on triton 3.6 and 3.9),
not at launch. For our kernels the launchers re-read TRITON_INTERPRET at every launch through
`launchable()` and pick the matching flavour of the same Python function. triton.language's own
jit helpers (tl.zeros, tl.sum, tl.max, ...) are decorated once at `import triton`, so a process
that wants the interpreter must still set the variable before triton is first imported (the
kernel test modules do this on machines without CUDA).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import os
import threading
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_FLAVOURS: dict[tuple[int, bool], object] = {}


def interpreting() -> bool:
    """True when TRITON_INTERPRET is set now (not when the kernel module was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=1)
def nvidia_sm80() -> bool:
    """The current device is an NVIDIA GPU of compute capability 8.0 or later."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


_pdl_allowed = True


@functools.lru_cache(maxsize=16)
def _sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


@functools.lru_cache(maxsize=16)
def _max_shared_mem(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def shared_memory_per_program(device: torch.device) -> int:
    """Bytes of shared memory one program may use on `device`, as Triton checks them before a
    launch (227 KB on an H100 or H200, 99 KB on sm_120 parts); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _max_shared_mem(index)


def sm90_or_later(device: torch.device) -> bool:
    """`device` is an NVIDIA GPU of compute capability 9.0 or later (TMA, PDL)."""
    if device.type != "cuda":
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (PDL): NVIDIA
    sm_90 and later, compiled (not interpreted), unless `programmatic_launch(False)` is in
    force. A PDL kernel starts with `pdl_start(PDL)`, and its launch passes `launch_pdl`."""
    if interpreting() or not _pdl_allowed:
        return False
    return sm90_or_later(device)


@contextlib.contextmanager
def programmatic_launch(enabled: bool) -> Iterator[None]:
    """Turn PDL launches off (or back on) for the calls made inside: for A/B benchmarks and for
    tests that compare the two. Process-wide; not for use while other threads launch."""
    global _pdl_allowed
    before, _pdl_allowed = _pdl_allowed, enabled
    try:
        yield
    finally:
        _pdl_allowed = before


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with PDL. It lets the next kernel
    in the stream launch as soon as every program of this one has started (its programs then
    wait here in turn), and waits until the kernel before this one has finished and its writes
    are visible. Every program runs it before touching global memory: a kernel's completion
    then implies its predecessor's, so stream order holds for all later kernels, PDL or not.
    Decode steps are chains of short kernels, so the launch gap at each boundary counts."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def even_split(steps: int, tiles: int, per_sm: float) -> int:
    """The K split (of `steps` steps) that brings `tiles` column tiles to about `per_sm`
    programs per SM of a 132-SM part, evened out so that no split is left without work."""
    split = max(1, min(steps, round(per_sm * 132 / tiles)))
    return triton.cdiv(steps, triton.cdiv(steps, split))


SATURATING_WARPS = 16  # per SM: more resident warps add no throughput (fitted, H100)


def split_cost(steps: int, tiles: int, per_sm: int, sms: int, warps: int, split: int) -> float:
    """When a K split of `steps` steps over `tiles` column tiles should end, in steps, with
    `per_sm` programs of `warps` warps fitting on each of `sms` SMs at once (inf for a split
    that leaves a program without work).

    Programs start in launch order (every tile of split 0, then of split 1, ...) in the first
    free slot and take their steps plus one step of start-up; and an SM runs at most
    SATURATING_WARPS warps' worth of steps at full speed, so its busiest share of the grid
    bounds the time too."""
    per = -(-steps // split)
    if not 1 <= split <= steps or (split - 1) * per >= steps:
        return float("inf")
    last = steps - (split - 1) * per
    programs = tiles * split
    free = [0] * min(per_sm * sms, programs)  # slot end times (a heap)
    end = 0
    for j in range(split):
        length = (per if j < split - 1 else last) + 1
        for _ in range(tiles):
            t = heapq.heappop(free) + length
            end = max(end, t)
            heapq.heappush(free, t)
    return max(end, -(-programs // sms) * (per + 1) * warps / SATURATING_WARPS)


@functools.lru_cache(maxsize=256)
def wave_split(steps: int, tiles: int, per_sm: int, sms: int, warps: int) -> int:
    """The K split that `split_cost` says ends first (the smaller on a tie), among those of
    at most two full waves. Unlike a fixed number of programs per SM, it sees when a grid
    would spill a few programs into a second wave."""
    limit = max(1, 2 * per_sm * sms // max(tiles, 1))
    candidates = range(1, min(steps, limit) + 1)
    return min(candidates, key=lambda s: (split_cost(steps, tiles, per_sm, sms, warps, s), s))


def launchable(kernel: JITFunction | InterpretedFunction) -> JITFunction | InterpretedFunction:
    """The kernel in the flavour (compiled or interpreted) that the current environment asks for."""
    want_interp = interpreting()
    if isinstance(kernel, InterpretedFunction) == want_interp:
        return kernel
    key = (id(kernel), want_interp)
    flavour = _FLAVOURS.get(key)
    if flavour is None:
        flavour = InterpretedFunction(kernel.fn) if want_interp else triton.jit(kernel.fn)
        _FLAVOURS[key] = flavour
    return flavour


class ZeroedWorkspace:
    """Per-device float32 scratch and int32 arrival counters, allocated as zeros and grown on
    demand but never during CUDA-graph capture: the first call at a size must come before
    capture. The counters are zeros between kernel calls (the kernels re-arm what they
    touch); so are the floats, except where the owner's kernels write them before reading
    them (`int4_mma`'s split-K partial sums). Buffers replaced by a larger pair are kept: a
    CUDA graph captured before the growth goes on using the pair it captured (the sizes a
    split-K kernel needs need not grow with the batch, so a smaller batch's warm-up can grow
    the workspace after a larger batch's graph was captured)."""

    def __init__(self, purpose: str) -> None:
        self._purpose = purpose
        self._lock = threading.Lock()
        self._by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._replaced: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get(
        self, device: torch.device, numel: int, counters: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            ws, cnt = self._by_device.get(device, (None, None))
            if ws is None or cnt is None or ws.numel() < numel or cnt.numel() < counters:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        f"{self._purpose} workspace must grow during CUDA-graph capture: "
                        "run the captured shapes once before capturing"
                    )
                if ws is not None and cnt is not None:
                    self._replaced.append((ws, cnt))
                ws = torch.zeros(max(numel, 1 << 20), dtype=torch.float32, device=device)
                cnt = torch.zeros(max(counters, 1 << 14), dtype=torch.int32, device=device)
                self._by_device[device] = (ws, cnt)
            return ws, cnt


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels index the last dimension with unit stride; every other stride is an argument."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {t.stride()}")
