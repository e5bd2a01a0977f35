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

import os

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_FLAVOURS: dict[tuple[int, bool], object] = {}


def interpreting() -> bool:
    """True when TRITON_INTERPRET is set now (not when the kernel module was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


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


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels index the last dimension with unit stride; every other stride is an argument."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {t.stride()}")


def check_q_and_kv_cache(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validate q (rows, k * num_kv_heads, head_dim) against a paged cache
    (2, num_blocks, block_size, num_kv_heads, head_dim); returns (block_size, Hkv, head_dim)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be (2, blocks, block_size, heads, dim), got {kv_cache.shape}"
        )
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be (rows, k * {num_kv_heads}, {head_dim}), got {q.shape}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}")
    return block_size, num_kv_heads, head_dim
