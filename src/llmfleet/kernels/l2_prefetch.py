"""Weight prefetch into L2 while a decode step waits on short kernels.

A batch-1 decode step streams every weight once, and between the projections it runs kernels
that read almost nothing but take microseconds each: the norms and their all-reduces (NVLink
round trips), rotary and attention. Memory sits idle there. This kernel asks the memory system
to bring the first bytes of the *next* projection's weight into L2 (Hopper's
`cp.async.bulk.prefetch.L2`, fire-and-forget: no data enters the SM and the kernel ends
without waiting for it), so that projection's first programs read those bytes from L2 and its
stream from HBM starts further in.

    prefetch_l2(weight, nbytes, gated)   # issued just before the short kernels

What to fetch follows the GEMV's order: its programs take consecutive rows in launch order,
so the first bytes it reads are the start of the weight, and, for a fused [gate | up] weight
read in pairs, the start of each half (`prefetch_ranges`).

It is a hint: results never depend on it, and it runs only where it can (compiled on sm_90 or
later). Under PDL the kernel lets the next kernel launch at once, issues its requests, then
waits for the kernel before it (as `pdl_start` does, at its end), so stream order holds.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmfleet.kernels.triton_utils import launchable, pdl, sm90_or_later

MODE = 1
CHUNK = 16 << 10  # bytes per bulk request
LANES = 32  # bulk requests per program (one warp, one each)
LINES = 1024  # line prefetches per program
ALIGN = 16  # a bulk request's address and size are multiples of this

# Bytes fetched per call as a fraction of the device's L2: the fetched lines must still be
# there when the projection reads them, after the short kernels' own traffic.
FRACTION = 0.3
_enabled = True


@functools.lru_cache(maxsize=16)
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def runs_on(device: torch.device) -> bool:
    """Whether prefetches are issued on `device`: compiled on sm_90 or later, PDL allowed
    (they rely on it to stay out of the stream's way), and not turned off."""
    return _enabled and pdl(device) and sm90_or_later(device)


def default_bytes(device: torch.device) -> int:
    """Bytes one call fetches unless told: FRACTION of the device's L2."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(_l2_bytes(index) * FRACTION) // ALIGN * ALIGN


def set_enabled(enabled: bool) -> None:
    """Issue prefetches (the default) or not, process-wide: the engine's `l2_prefetch`."""
    global _enabled
    _enabled = enabled


def prefetch_ranges(nbytes_total: int, nbytes: int, gated: bool) -> list[tuple[int, int]]:
    """(offset, size) byte ranges of a weight of `nbytes_total` bytes to fetch for `nbytes`:
    its start, or with `gated` the start of each half; sizes rounded down to ALIGN, empty
    ranges left out."""
    if nbytes_total < 0 or nbytes < 0:
        raise ValueError(f"byte counts must be >= 0, got {nbytes_total} and {nbytes}")
    if gated:
        half = nbytes_total // 2
        size = min(nbytes // 2, half) // ALIGN * ALIGN
        ranges = [(0, size), (half // ALIGN * ALIGN, size)]
    else:
        ranges = [(0, min(nbytes, nbytes_total) // ALIGN * ALIGN)]
    return [(off, size) for off, size in ranges if size > 0]


@triton.jit
def _bulk_prefetch(base, off, nbytes, CHUNK: tl.constexpr):
    """Each lane asks for CHUNK bytes (fewer at the end) of base[0 : nbytes] at `off`."""
    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base + off, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _line_prefetch(base, off, nbytes, EVICT_LAST: tl.constexpr):
    """Each element asks for the 128-byte line at base + off, where off < nbytes."""
    inside = (off < nbytes).to(tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; "
            "@p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [base + off, inside],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [base + off, inside],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _l2_prefetch_kernel(
    a_ptr,  # uint8: the first range
    a_bytes,
    b_ptr,  # uint8: the second range (b_bytes = 0: none)
    b_bytes,
    CHUNK: tl.constexpr,  # bytes per request: a bulk request's, or 128 (one line)
    LANES: tl.constexpr,  # requests per program
    MODE: tl.constexpr,  # 0: bulk requests; 1: line prefetches; 2: line, evict-last
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    off = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    if MODE == 0:
        _bulk_prefetch(a_ptr, off, a_bytes, CHUNK)
        _bulk_prefetch(b_ptr, off, b_bytes, CHUNK)
    else:
        _line_prefetch(a_ptr, off, a_bytes, MODE == 2)
        _line_prefetch(b_ptr, off, b_bytes, MODE == 2)
    if PDL:  # this kernel's end then implies its predecessor's (pdl_start)
        gdc_wait()


def prefetch_l2(
    weight: torch.Tensor,
    nbytes: int | None = None,
    gated: bool = False,
    mode: int | None = None,
    lanes: int | None = None,
    chunk: int | None = None,
) -> None:
    """Start bringing the first `nbytes` (default: `default_bytes`) of `weight` into L2
    (`gated`: of each half). Returns at once; does nothing where it does not run (`runs_on`)."""
    if weight.device.type != "cuda" or not weight.is_contiguous() or not runs_on(weight.device):
        return
    if nbytes is None:
        nbytes = default_bytes(weight.device)
    ranges = prefetch_ranges(weight.numel() * weight.element_size(), nbytes, gated)
    if not ranges:
        return
    raw = weight.view(-1).view(torch.uint8)
    (a_off, a_size), (b_off, b_size) = ranges[0], (ranges + [(0, 0)])[1]
    longest = max(a_size, b_size)
    mode = MODE if mode is None else mode
    lanes = (LANES if mode == 0 else LINES) if lanes is None else lanes
    chunk = (CHUNK if mode == 0 else 128) if chunk is None else chunk
    grid = (triton.cdiv(triton.cdiv(longest, chunk), lanes),)
    chained = pdl(weight.device)
    launchable(_l2_prefetch_kernel)[grid](
        raw[a_off:], a_size, raw[b_off:], b_size,
        CHUNK=chunk, LANES=lanes, MODE=mode, PDL=chained, num_warps=max(1, min(lanes // 32, 8)),
        launch_pdl=chained,
    )  # fmt: skip
