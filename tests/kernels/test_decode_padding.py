"""A decode batch padded for a CUDA graph, through the Triton attention backend, equals the
unpadded batch through the reference: padding rows write no KV and real rows' outputs match,
with the grid sized from the static context bound instead of the batch's longest context.

Compiled on a CUDA machine (where the bound of 1024 tokens splits every context into four
partitions, so padding rows also go through the split-K reduction), in Triton's interpreter on
the CPU (one partition).
"""

from __future__ import annotations

import os

import torch

# See test_attention_kernels.py: on a CPU-only machine the interpreter flag must be set before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from tiny_models import greedy_tokens  # noqa: E402

from llmfleet.engine.cuda_graphs import (  # noqa: E402
    DecodeBuffers,
    PaddedDecoder,
)
from llmfleet.engine.engine import LLMEngine  # noqa: E402
from llmfleet.models.attention.metadata import AttentionMetadata  # noqa: E402
from llmfleet.models.attention.reference import TorchReferenceBackend  # noqa: E402
from llmfleet.models.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from llmfleet.models.loader import load_model  # noqa: E402
from llmfleet.shared.core.config import EngineConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5 if DEVICE == "cpu" else 5e-3  # compiled fp32 dots may use tf32


@pytest.mark.parametrize(("seq_lens", "padded"), [([1, 10, 5], 4), ([37], 2), ([3, 600], 8)])
def test_padded_decode_equals_unpadded(seq_lens: list[int], padded: int) -> None:
    g = torch.Generator().manual_seed(len(seq_lens) * 100 + padded)
    heads, kv_heads, dim, block_size, num_blocks, max_len = 4, 2, 16, 4, 200, 1024
    n = len(seq_lens)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 stays unused
    tables, used = [], 0
    for s in seq_lens:
        nb = -(-s // block_size)
        tables.append(perm[used : used + nb].tolist())
        used += nb
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(DEVICE)
    q = torch.randn(padded, heads, dim, generator=g).to(DEVICE)
    k = torch.randn(padded, kv_heads, dim, generator=g).to(DEVICE)
    v = torch.randn(padded, kv_heads, dim, generator=g).to(DEVICE)

    ref_cache = cache.clone()
    ref_meta = AttentionMetadata.build([1] * n, seq_lens, tables, block_size, device=DEVICE)
    ref = TorchReferenceBackend().forward(q[:n], k[:n], v[:n], ref_cache, ref_meta, dim**-0.5)

    width = max_len // block_size
    host = DecodeBuffers(padded, width, block_size)
    dev = DecodeBuffers(padded, width, block_size, device=DEVICE)
    host.fill(list(range(3, 3 + n)), [s - 1 for s in seq_lens], tables, padded)
    dev.copy_from(host, padded)
    meta = dev.metadata(padded, max_seq_len=max_len)
    backend = TritonAttentionBackend(force_triton=True)
    out = backend.forward(q, k, v, cache, meta, dim**-0.5)

    assert torch.equal(cache, ref_cache), "padding rows must not write KV"
    err = (out[:n] - ref).abs().max().item()
    assert err <= TOL * max(1.0, ref.abs().max().item()), err
    assert torch.isfinite(out).all(), "padding rows read a finite context"


def test_engine_on_the_padded_path_gives_eager_tokens(make_checkpoint, tmp_path) -> None:
    """The whole step as a graph replays it (3 sequences padded to 4, static buffers, bound
    metadata), run eagerly, against the engine's unpadded step: the same greedy tokens."""
    steps = 6
    backend = TritonAttentionBackend(force_triton=True)
    loaded = load_model(
        str(make_checkpoint("llama", tmp_path)), device=DEVICE, backend=backend, progress=False
    )
    cfg = EngineConfig(device=DEVICE, block_size=16, num_kv_blocks=32, cuda_graph_max_batch_size=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 17, 33)]
    want = greedy_tokens(LLMEngine(cfg, loaded), prompts, steps)
    engine = LLMEngine(cfg, loaded)
    padded = PaddedDecoder(
        loaded.model,
        engine.runner.kv_caches,
        max_batch_size=4,
        max_model_len=engine.max_model_len,
        vocab_size=loaded.spec.vocab_size,
    )
    assert padded.sizes == [1, 2, 4]
    engine.runner.decode_graphs = padded
    assert greedy_tokens(engine, prompts, steps) == want
    assert padded.num_replays == steps - 1
    assert engine.num_free_blocks == 32


def test_speculation_on_the_padded_path_gives_eager_tokens(make_checkpoint, tmp_path) -> None:
    """The target as its own draft, both replaying the padded decode step as their graphs
    would: the target's verification rows (a sequence's token and its drafts) and the draft's
    steady catch-up (a token or two a request, a row each) go through it, and the greedy tokens
    equal those of the engine without speculation."""
    from llmfleet.shared.core.speculative import SpeculativeConfig

    steps = 10
    backend = TritonAttentionBackend(force_triton=True)
    path = str(make_checkpoint("llama", tmp_path))
    loaded = load_model(path, device=DEVICE, backend=backend, progress=False)
    cfg = dict(device=DEVICE, block_size=16, num_kv_blocks=32, cuda_graph_max_batch_size=0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 19)]
    want = greedy_tokens(LLMEngine(EngineConfig(**cfg), loaded), prompts, steps)
    spec = SpeculativeConfig("draft", model=path, num_speculative_tokens=2)
    engine = LLMEngine(EngineConfig(model=path, speculative=spec, **cfg), loaded)
    draft = engine.speculator.proposer

    def padded(runner) -> PaddedDecoder:
        return PaddedDecoder(
            loaded.model, runner.kv_caches, max_batch_size=8, max_model_len=64,
            vocab_size=loaded.spec.vocab_size,
        )  # fmt: skip

    engine.runner.decode_graphs = padded(engine.runner)
    draft.runner.decode_graphs = padded(draft.runner)
    graphed = []
    catch_up = draft._catch_up_graphed
    draft._catch_up_graphed = lambda rows, q: graphed.append(catch_up(rows, q)) or graphed[-1]
    assert greedy_tokens(engine, prompts, steps) == want
    assert engine.spec_stats.num_accepted == engine.spec_stats.num_drafted > 0  # self-draft
    assert engine.runner.decode_graphs.num_replays > 0  # verification rows
    assert sum(t is not None for t in graphed) >= 2  # steady catch-ups replayed
