"""Kernel tests: compiled on a CUDA GPU, Triton's CPU interpreter elsewhere (small sizes).

`triton.jit` reads TRITON_INTERPRET when a kernel module is imported, so every test module sets
it before its imports; this fixture fails loudly if triton was imported earlier without it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _triton_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: rerun with it set")
