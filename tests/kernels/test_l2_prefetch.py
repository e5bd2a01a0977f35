"""The L2 weight prefetch (kernels/l2_prefetch.py): which bytes it asks for, that it stays
off where it cannot run, and (GPU) that results are those without it, in CUDA graphs too."""

from __future__ import annotations

import os

import torch

# Must precede `import triton` on a CPU-only machine: see test_attention_kernels.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from llmfleet.kernels import dispatch  # noqa: E402
from llmfleet.kernels import l2_prefetch as l2  # noqa: E402
from llmfleet.kernels.gemv import gemv, gemv_ref  # noqa: E402


def test_ranges_follow_the_gemv_read_order() -> None:
    # the start of the weight, capped at its size, sizes rounded down to 16 bytes
    assert l2.prefetch_ranges(1000, 100, gated=False) == [(0, 96)]
    assert l2.prefetch_ranges(1000, 5000, gated=False) == [(0, 992)]
    # gated: half the bytes from the start of each half
    assert l2.prefetch_ranges(4096, 1024, gated=True) == [(0, 512), (2048, 512)]
    assert l2.prefetch_ranges(4096, 1 << 20, gated=True) == [(0, 2048), (2048, 2048)]
    # nothing to fetch: no range
    assert l2.prefetch_ranges(1000, 15, gated=False) == []
    assert l2.prefetch_ranges(0, 1 << 20, gated=True) == []
    with pytest.raises(ValueError, match="byte counts"):
        l2.prefetch_ranges(1000, -1, gated=False)


def test_off_where_it_cannot_run() -> None:
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    assert not l2.runs_on(w.device)
    l2.prefetch_l2(w)  # a no-op on the CPU, not an error
    dispatch.prefetch_weight(torch.randn(1, 32, dtype=torch.bfloat16), w)
    l2.set_enabled(False)
    try:
        if torch.cuda.is_available():
            assert not l2.runs_on(torch.device("cuda"))
    finally:
        l2.set_enabled(True)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_results_unchanged_eager_and_in_graphs(gated: bool) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 0.05)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    assert l2.runs_on(w.device)  # an H100/H200: the prefetch is issued
    want = gemv_ref(x, w, gated=gated)
    l2.prefetch_l2(w, gated=gated)
    l2.prefetch_l2(w, 1 << 30, gated=gated)  # more than the weight: capped at it
    assert torch.equal(gemv(x, w, gated=gated), want)

    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        l2.prefetch_l2(w, gated=gated)
        out = gemv(x, w, gated=gated)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv_ref(x, w, gated=gated))
