"""The engine at tensor-parallel size 2 (two CPU processes, gloo) against size 1: the same
greedy tokens for a dense and an MoE model (chunked prefill, prefix-cache hits), KV payloads
that do not depend on the TP size (handed from TP=1 to TP=2 and back), and a follower rank
that dies failing the next step loudly."""

from __future__ import annotations

import pytest
import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.engine.tp_ranks import RankFailed
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Prompts longer than a step's 16 tokens: their prefill runs in chunks.
CFG = dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=16, num_threads=1)


def engine(path, tp: int) -> LLMEngine:
    config = EngineConfig(model=str(path), tensor_parallel_size=tp, **CFG)
    return LLMEngine(config, load_for(config))


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def drain(engine: LLMEngine, requests: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    """Each request's greedy tokens."""
    return {rid: tokens for rid, (tokens, _) in run_all(engine, requests).items()}


def run_all(
    engine: LLMEngine, requests: list[tuple[str, list[int]]]
) -> dict[str, tuple[list[int], int]]:
    """Each request's greedy tokens and cached prompt tokens."""
    for rid, ids in requests:
        engine.add_request(rid, ids, GREEDY)
    out: dict[str, list[int]] = {rid: [] for rid, _ in requests}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    return {rid: (out[rid], cached[rid]) for rid, _ in requests}


def test_tensor_parallel_size_is_validated(make_checkpoint_module):
    for bad in ({"tensor_parallel_size": 0}, {"simulate": True}):
        with pytest.raises(ValidationError) as e:
            EngineConfig(**{"tensor_parallel_size": 2, **bad})
        assert e.value.field == "tensor_parallel_size"
    # A model loaded without its ranks cannot run at TP=2.
    loaded = load_model(str(make_checkpoint_module("llama")), progress=False)
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        LLMEngine(EngineConfig(tensor_parallel_size=2, **CFG), loaded)


def test_moe_tp2_gives_the_tp1_tokens(make_checkpoint_module):
    # One KV head: replicated on both ranks, its 4 query heads split 2 + 2; experts split too.
    path = make_checkpoint_module("qwen3_moe", num_key_value_heads=1)
    batch = list(zip("abc", prompts([21, 6, 13], seed=1), strict=True))
    want = drain(engine(path, 1), batch)
    two = engine(path, 2)
    try:
        assert drain(two, batch) == want
        payload = two.kv.read_blocks([0, 1])
        assert payload.shape == (2, 3, 2, 4, 1, 16)  # one head, read once
    finally:
        two.close()


def test_a_dead_follower_fails_the_next_step(make_checkpoint_module):
    two = engine(make_checkpoint_module("llama"), 2)
    try:
        follower = two.runner.ranks.procs[0]
        follower.kill()
        follower.wait()
        two.add_request("r", prompts([5])[0], GREEDY)
        with pytest.raises(RankFailed, match="rank 1 exited"):
            two.step()
    finally:
        two.close()


# The tests below share one TP=2 engine; a process holds one tensor-parallel group at a
# time, so the tests above (each with its own) run first.
@pytest.fixture(scope="module")
def dense(make_checkpoint_module):
    # 6 query heads over 3 KV heads: at TP=2 rank 0 holds KV heads 0-1, rank 1 head 2.
    path = make_checkpoint_module(
        "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3
    )
    one, two = engine(path, 1), engine(path, 2)
    yield one, two
    two.close()


def test_dense_tp2_gives_the_tp1_tokens_with_chunks_and_prefix_hits(dense):
    one, two = dense
    a, b, c = prompts([37, 9, 23])
    batch = [("a", a), ("b", b), ("c", c)]
    assert drain(two, batch) == drain(one, batch)
    # A prompt sharing a's first 32 tokens reuses their 8 cached blocks on both.
    again = [("d", a[:32] + [7, 8, 9, 10, 11])]
    got, want = run_all(two, again)["d"], run_all(one, again)["d"]
    assert got == want and got[1] == 32  # the same tokens, 32 prompt tokens cached
    assert two.num_free_blocks == one.num_free_blocks


def handoff(
    src: LLMEngine, dst: LLMEngine, rid: str, ids: list[int]
) -> tuple[list[int], torch.Tensor]:
    """Prefill on `src`, its KV written into a reservation on `dst`, decode there: the tokens
    and the KV payload handed over."""
    src.add_request(rid, ids, GREEDY, prefill_only=True)
    first = [t for o in src.step() for t in o.new_token_ids]
    while src.has_unfinished():
        first += [t for o in src.step() for t in o.new_token_ids]
    payload = src.kv.read_blocks(src.kv.pinned_block_ids(rid))
    src.kv.release_pinned(rid)
    assert dst.kv.reserve(f"lease-{rid}", len(ids)) == payload.shape[0]
    dst.kv.write_reserved(f"lease-{rid}", 0, payload)
    dst.start_decode(f"lease-{rid}", rid, ids, first[0], GREEDY)
    rest = []
    while dst.has_unfinished():
        rest += [t for o in dst.step() for t in o.new_token_ids]
    return [first[0], *rest], payload


def test_kv_payloads_are_the_same_at_either_tp_size_and_hand_off_both_ways(dense):
    one, two = dense
    [p] = prompts([18], seed=2)
    want = drain(one, [("w", p)])["w"]
    assert one.kv.block_shape == two.kv.block_shape == (2, 2, 4, 3, 8)  # all 3 heads
    # TP=1 prefill, TP=2 decode: the payload's heads are split over the ranks.
    got, from_one = handoff(one, two, "p1", p)
    assert got == want
    # TP=2 prefill (its ranks' heads gathered), TP=1 decode.
    got, from_two = handoff(two, one, "p2", p)
    assert got == want
    assert from_one.shape == from_two.shape == (5, 2, 2, 4, 3, 8)
    assert from_one.abs().amax() > 0
    torch.testing.assert_close(from_two, from_one)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_with_cuda_graphs_gives_the_tp1_tokens_on_two_gpus(make_checkpoint_module):
    """Both ranks capture their decode graphs (collectives inside) and replay them together:
    float32 greedy tokens equal TP=1's, through async scheduling's chained steps too, with the
    decode steps' sums on the one-shot all-reduce (fused with the norms) and with NCCL."""
    path = make_checkpoint_module("llama")
    reqs = prompts([5, 21, 9, 40], seed=5)

    def one_shot(eng: LLMEngine, tp: int) -> None:
        assert (eng.runner.model.tp.peer is not None) == (tp > 1)

    got = graphed_tokens_at_tp1_and_tp2(path, reqs, one_shot)
    assert got[2] == got[1]
    nccl = graphed_tokens_at_tp1_and_tp2(path, reqs, tp_all_reduce="nccl")
    assert nccl[2] == got[1]


def graphed_tokens_at_tp1_and_tp2(
    path, reqs: list[list[int]], inspect=None, **config
) -> dict[int, dict]:
    """{tp: each request's greedy tokens} at TP=1 and TP=2 on CUDA, decode graphs on;
    `inspect(engine, tp)` sees each engine before it runs."""
    got = {}
    for tp in (1, 2):
        cfg = EngineConfig(
            model=str(path), device="cuda", tensor_parallel_size=tp, cuda_graph_max_batch_size=8,
            **CFG, **config,
        )  # fmt: skip
        eng = LLMEngine(cfg, load_for(cfg))
        try:
            assert eng.runner.decode_graphs is not None
            if inspect is not None:
                inspect(eng, tp)
            got[tp] = drain(eng, [(f"r{i}", ids) for i, ids in enumerate(reqs)])
        finally:
            eng.close()
    return got


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_fp8_follows_tp1_fp8_on_two_gpus(make_checkpoint_module):
    """FP8 at TP=2, CUDA graphs on: each rank quantizes its shard (a row-parallel projection
    with scales over its own columns, so rounding differs from TP=1's). Greedy tokens follow
    TP=1 FP8's; where they part, TP=1's two best logits were a near tie."""
    from tiny_models import top2_margin

    path = make_checkpoint_module("llama", hidden_size=256, intermediate_size=512)
    reqs = prompts([7, 23, 40], seed=3)
    got = graphed_tokens_at_tp1_and_tp2(path, reqs, dtype="bfloat16", quantization="fp8")
    one = load_model(str(path), dtype=torch.bfloat16, device="cuda", quantization="fp8")
    parted = 0
    for i, ids in enumerate(reqs):
        a, b = got[2][f"r{i}"], got[1][f"r{i}"]
        assert len(a) == len(b) == GREEDY.max_tokens
        first = next((j for j, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), None)
        if first is not None:
            parted += 1
            assert top2_margin(one, ids + b[:first]) < 0.2, (i, first, a, b)
    print(f"\nTP=2 fp8: {len(reqs) - parted}/{len(reqs)} prompts equal TP=1 fp8's tokens")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_keeps_the_bundled_models_int4_weights_packed_on_two_gpus():
    """The bundled GGUF at TP=2 on CUDA keeps its Q4 projections packed on each rank (o_proj
    and down_proj row-parallel, summing over the group); bf16 greedy tokens follow TP=1's
    (packed too), and where they part TP=1's two best logits were a near tie."""
    from tiny_models import top2_margin

    from llmfleet.models.checkpoint_files import resolve_model_path
    from llmfleet.models.int4_linear import Int4Linear

    path = str(resolve_model_path(None))

    def packed(eng: LLMEngine, tp: int) -> None:
        modules = [m for m in eng.runner.model.modules() if isinstance(m, Int4Linear)]
        assert len(modules) == 4 * eng.spec.num_layers
        assert sum(m.tp is not None for m in modules) == (2 * eng.spec.num_layers if tp > 1 else 0)

    reqs = prompts([12, 40, 25], seed=7)
    got = graphed_tokens_at_tp1_and_tp2(path, reqs, packed, dtype="bfloat16")
    one = load_model(path, dtype=torch.bfloat16, device="cuda")
    parted = 0
    for i, ids in enumerate(reqs):
        a, b = got[2][f"r{i}"], got[1][f"r{i}"]
        first = next((j for j, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), None)
        if first is not None:
            parted += 1
            assert top2_margin(one, ids + b[:first]) < 0.1, (i, first, a, b)
    print(f"\nTP=2 packed INT4: {len(reqs) - parted}/{len(reqs)} prompts equal TP=1's tokens")
