"""Programmatic dependent launch (PDL) on the decode path's kernels (kernels/triton_utils.py).

A PDL kernel may start before the kernel ahead of it in the stream has finished; it must wait
(`pdl_start`) before it touches memory. The `gpu` test runs decoder layers built from those
kernels (norm, GEMV, rotary + KV-cache write, split decode attention, SiLU-and-mul), each
reading what the one before wrote, as a CUDA graph and eagerly with PDL on, on fresh inputs
every time, and requires the same bits as the kernels launched without PDL: a kernel that read
its input early would see the previous input.
"""

from __future__ import annotations

import os

import torch

# Must precede `import triton` on a CPU-only machine: see test_attention_kernels.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from llmfleet.kernels import triton_utils  # noqa: E402
from llmfleet.kernels.gemv import gemv  # noqa: E402
from llmfleet.kernels.paged_attention_decode import (  # noqa: E402
    choose_partitions,
    default_decode_config,
    paged_attention_decode,
)
from llmfleet.kernels.rms_norm import rms_norm  # noqa: E402
from llmfleet.kernels.rotary import build_cos_sin_cache  # noqa: E402
from llmfleet.kernels.rotary_kv_write import rotary_kv_cache_write  # noqa: E402
from llmfleet.kernels.silu_and_mul import silu_and_mul  # noqa: E402
from llmfleet.kernels.triton_utils import pdl, programmatic_launch  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 4, 64, 2816
BLOCK, CONTEXT, LAYERS = 16, 3000, 4


def test_pdl_only_for_compiled_cuda_kernels() -> None:
    assert not pdl(torch.device("cpu"))
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert pdl(cuda) == (torch.cuda.get_device_capability() >= (9, 0))
        with programmatic_launch(False):
            assert not pdl(cuda)
    else:  # the interpreter never launches with PDL
        assert triton_utils.interpreting()
        assert not pdl(torch.device("cuda"))
    with pytest.raises(RuntimeError), programmatic_launch(False):
        raise RuntimeError("the switch is restored on the way out")
    assert triton_utils._pdl_allowed


def _layer(x: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer at decode batch 1; returns (mlp out, residual)."""
    h = rms_norm(x, p["norm1"], 1e-5)
    qkv = gemv(h, p["qkv"])  # (1, (HEADS + 2 KV_HEADS) HEAD_DIM)
    q = qkv[:, : HEADS * HEAD_DIM].view(1, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(1, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(1, KV_HEADS, HEAD_DIM)
    rotary_kv_cache_write(p["positions"], q, k, v, p["cos_sin"], p["cache"], p["slot"])
    att = paged_attention_decode(
        q, p["cache"], p["block_table"], p["seq_lens"], HEAD_DIM**-0.5, CONTEXT
    )
    o = gemv(att.view(1, HEADS * HEAD_DIM), p["o"])
    h2, residual = rms_norm(o, p["norm2"], 1e-5, residual=x)  # type: ignore[misc]
    return gemv(silu_and_mul(gemv(h2, p["gate_up"])), p["down"]), residual


def _model(x: torch.Tensor, layers: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    outs = []
    for p in layers:
        x, residual = _layer(x, p)
        outs += [x, residual]
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_chain_matches_plain_launches() -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90 or later")
    cfg = default_decode_config()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    parts, _ = choose_partitions(1, KV_HEADS, CONTEXT, cfg.block_n, sms, cfg.min_partition)
    assert parts > 1  # attention runs as two kernels, partial and reduce
    dev, dt = "cuda", torch.bfloat16
    blocks = CONTEXT // BLOCK + 1
    layers = []
    for _ in range(LAYERS):
        cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        layers.append(
            {
                "norm1": torch.rand(HIDDEN, device=dev, dtype=dt) + 0.5,
                "norm2": torch.rand(HIDDEN, device=dev, dtype=dt) + 0.5,
                "qkv": torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, device=dev, dtype=dt)
                * 0.03,
                "o": torch.randn(HIDDEN, HEADS * HEAD_DIM, device=dev, dtype=dt) * 0.03,
                "gate_up": torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt) * 0.03,
                "down": torch.randn(HIDDEN, INTER, device=dev, dtype=dt) * 0.02,
                "cache": cache,
                "cos_sin": build_cos_sin_cache(HEAD_DIM, 4096, device=dev),
                "positions": torch.tensor([CONTEXT - 1], device=dev),
                "slot": torch.tensor([CONTEXT - 1], device=dev),  # the last token's slot
                "block_table": torch.randperm(blocks, device=dev, dtype=torch.int32)[None, :],
                "seq_lens": torch.tensor([CONTEXT], device=dev, dtype=torch.int32),
            }
        )
    x = torch.empty(1, HIDDEN, device=dev, dtype=dt)  # the graph's input
    assert pdl(x.device)
    _model(x.normal_(), layers)  # compile, and size the workspaces, before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _model(x, layers)
    for trial in range(30):
        x.normal_()
        graph.replay()
        from_graph = [t.clone() for t in captured]
        eager = [t.clone() for t in _model(x, layers)]
        with programmatic_launch(False):
            plain = _model(x, layers)
        for i, (g, e, ref) in enumerate(zip(from_graph, eager, plain, strict=True)):
            assert torch.equal(g, ref), f"trial {trial}: graph output {i} differs"
            assert torch.equal(e, ref), f"trial {trial}: eager output {i} differs"
