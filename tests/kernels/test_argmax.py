"""The two-pass argmax (kernels/argmax.py) against torch.argmax: ties to the lowest index
across and within pieces, NaN and -inf rows, ragged last pieces."""

from __future__ import annotations

import os

import torch

# Must precede `import triton` on a CPU-only machine: see test_attention_kernels.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from llmfleet.kernels import dispatch  # noqa: E402
from llmfleet.kernels.argmax import CHUNK, argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,vocab", [(1, 100), (1, CHUNK), (3, 2 * CHUNK + 17), (5, 49152)])
def test_argmax_matches_torch_on_random_rows(rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g).to(DEVICE)
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    # a strided row view (the sampler's logits can be a slice of a wider buffer)
    wide = torch.randn(rows, vocab + 8, generator=g).to(DEVICE)
    assert torch.equal(argmax(wide[:, :vocab]), wide[:, :vocab].argmax(dim=-1))


def test_ties_nan_and_masked_rows_follow_torch() -> None:
    vocab = 2 * CHUNK + 5
    x = torch.full((5, vocab), -1.0, device=DEVICE)
    x[0, [7, CHUNK + 3, 2 * CHUNK + 1]] = 2.0  # a tie across pieces: the lowest index
    x[1, [CHUNK + 9, CHUNK + 4]] = 3.0  # a tie inside one piece
    x[2, [5, CHUNK + 1]] = float("nan")  # NaN counts as the largest, the first one wins
    x[2, 3] = float("inf")
    x[3] = float("-inf")  # every token masked: index 0, as torch
    x[4, vocab - 1] = 9.0  # in the ragged last piece
    want = [7, CHUNK + 4, 5, 0, vocab - 1]
    assert argmax(x).tolist() == want
    assert x.argmax(dim=-1).tolist() == want


def test_dispatch_keeps_torch_where_the_kernel_does_not_serve() -> None:
    x = torch.randn(2, 300, device=DEVICE)
    half = x.half()
    assert torch.equal(dispatch.argmax(half, force_triton=True), half.argmax(dim=-1))
    assert torch.equal(dispatch.argmax(x, force_triton=True), x.argmax(dim=-1))
    with pytest.raises(ValueError, match="float32"):
        argmax(half)
