"""Tensor parallelism on CPU: two gloo ranks (spawned processes) each build their shard of a
model and run it; prefill logits and greedy tokens must match the unsplit model's.

One module-scoped group of 2 worker processes runs every case: the parent sends a case to both
ranks, each loads its shard (`load_model` / `random_model` with `tp`), runs a prefill and
greedy decode steps over its own paged KV cache, and sends back its logits and tokens.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import re
import shutil
import socket
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from mm_checkpoints.llava import make_llava_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file
from test_gguf import write_tiny_llama_gguf
from test_int4_gguf import ALL_Q4
from tiny_models import Runner, assert_logits_close, build_hf_model, random_prompts
from transformers import AutoConfig

from llmfleet.models.fp8_linear import Fp8Linear, use_fp8_linears
from llmfleet.models.int4_linear import Int4Linear
from llmfleet.models.loader import LoadedModel, load_model, random_model
from llmfleet.models.parallel import TensorParallel, kv_head_partition, split_evenly

SIZE = 2
DECODE_STEPS = 8
CASE_TIMEOUT_S = 120.0


# ---- the pure partition -------------------------------------------------------------------


def _check_partition(num_kv: int, num_heads: int, size: int) -> list[tuple[range, range]]:
    parts = kv_head_partition(num_kv, num_heads, size)
    group = num_heads // num_kv
    assert len(parts) == size
    covered = []
    for kv, q in parts:
        assert len(q) >= 1 and len(kv) >= 1
        assert all(h // group in kv for h in q)  # a rank's queries read its own KV heads
        covered += list(q)
    assert covered == list(range(num_heads))  # each query head on exactly one rank, in order
    return parts


def test_kv_head_partition_even_uneven_and_replicated() -> None:
    assert _check_partition(8, 32, 2) == [(range(0, 4), range(0, 16)), (range(4, 8), range(16, 32))]
    # SmolLM2-135M: 9 query heads, 3 KV heads, at size 2.
    assert _check_partition(3, 9, 2) == [(range(0, 2), range(0, 6)), (range(2, 3), range(6, 9))]
    # Fewer KV heads than ranks: each KV head replicated, its query heads split.
    assert _check_partition(1, 4, 2) == [(range(0, 1), range(0, 2)), (range(0, 1), range(2, 4))]
    assert [kv.start for kv, _ in _check_partition(2, 8, 4)] == [0, 0, 1, 1]
    assert [kv.start for kv, _ in _check_partition(3, 6, 4)] == [0, 0, 1, 2]
    assert _check_partition(4, 4, 1) == [(range(0, 4), range(0, 4))]


def test_kv_head_partition_rejects_impossible_splits() -> None:
    with pytest.raises(ValueError, match="cannot be split over 8 ranks"):
        kv_head_partition(2, 4, 8)
    with pytest.raises(ValueError, match="not divisible"):
        kv_head_partition(3, 4, 2)


def test_split_evenly() -> None:
    assert [split_evenly(97, 2, r) for r in range(2)] == [range(0, 49), range(49, 97)]
    assert [len(split_evenly(10, 4, r)) for r in range(4)] == [3, 3, 2, 2]


# ---- two gloo ranks -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """What a rank loads: an HF checkpoint directory, or a random model of a config."""

    path: str | None = None
    config: dict[str, Any] | None = None
    fp8: bool = False  # the decoder projections quantized to FP8 after loading (reference GEMM)
    int4: bool = False  # GGUF Q4 projections kept packed (Int4Linear, reference kernel)

    def load(self, tp: TensorParallel | None = None) -> LoadedModel:
        if self.path is not None:
            loaded = load_model(self.path, progress=False, tp=tp, int4_weights=self.int4 or None)
            if self.fp8:
                use_fp8_linears(loaded.model)
            return loaded
        assert self.config is not None
        config = AutoConfig.for_model(**self.config)
        return random_model(config, seed=5, std=0.1, tp=tp)


def run_greedy(loaded: LoadedModel, steps: int = DECODE_STEPS) -> tuple[torch.Tensor, list]:
    """Prefill of three prompts in one step, then `steps` greedy decode steps of all three:
    (prefill logits (sum of prompt lengths, V), greedy tokens per prompt)."""
    prompts = random_prompts(loaded.spec.vocab_size)
    runner = Runner(loaded, [len(p) + steps for p in prompts])
    logits = runner.step(prompts, [0] * len(prompts))
    tokens = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(steps - 1):
        starts = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)]
        out = runner.step([t[-1:] for t in tokens], starts)  # a pure decode step
        for t, lg in zip(tokens, out, strict=True):
            t.append(int(lg[-1].argmax()))
    return torch.cat(logits), tokens


def _rank_main(rank: int, port: int, tasks: Any, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE
    )
    tp = TensorParallel(rank=rank, size=SIZE, group=dist.group.WORLD)
    try:
        while (task := tasks.get()) is not None:
            seq, case = task
            try:
                if case == "collectives":
                    results.put((seq, rank, "ok", _collectives(tp)))
                    continue
                if isinstance(case, tuple):  # ("row logits", Case)
                    results.put((seq, rank, "ok", _row_logits(case[1].load(tp))))
                    continue
                loaded = case.load(tp)
                spec = loaded.spec
                logits, tokens = run_greedy(loaded)
                kv = (spec.num_kv_heads, spec.total_num_kv_heads, spec.kv_head_start)
                results.put((seq, rank, "ok", (logits, tokens, kv, packed_int4(loaded))))
            except Exception:  # reported to the test, which fails with it
                results.put((seq, rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def packed_int4(loaded: LoadedModel) -> dict[str, bool]:
    """Each Int4Linear of the model: whether it is row-parallel (sums over the group)."""
    return {
        n: m.tp is not None for n, m in loaded.model.named_modules() if isinstance(m, Int4Linear)
    }


def _collectives(tp: TensorParallel) -> tuple[list[float], list[float], list[float]]:
    mine = torch.tensor([tp.rank + 1.0, 10.0 * (tp.rank + 1)])
    reduced = tp.all_reduce(mine.clone())
    gathered = tp.all_gather(mine.view(1, 2), dim=1)
    broadcast = tp.broadcast(mine.clone(), src=1)
    return reduced.tolist(), gathered.view(-1).tolist(), broadcast.tolist()


@torch.inference_mode()
def _row_logits(loaded: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's logits, returned and written into a given `out` (a decode graph's buffer:
    the ranks' columns gathered in place there)."""
    hidden = torch.randn(1, loaded.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    model = loaded.model
    out = torch.full((1, loaded.spec.vocab_size), float("nan"))
    assert model.compute_logits(hidden, out=out) is out
    return model.compute_logits(hidden), out


class RankPool:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.results = ctx.Queue()
        self.seq = 0  # numbers the cases, so a late result of a failed one is dropped
        self.tasks = [ctx.Queue() for _ in range(SIZE)]
        self.procs = [
            ctx.Process(target=_rank_main, args=(r, port, self.tasks[r], self.results), daemon=True)
            for r in range(SIZE)
        ]
        for p in self.procs:
            p.start()

    def run(self, case: Case | str) -> list[Any]:
        """Each rank's result: for a Case, (prefill logits, greedy tokens, (its KV heads,
        total, first), `packed_int4`); for "collectives", what `_collectives` returns."""
        self.seq += 1
        for q in self.tasks:
            q.put((self.seq, case))
        got: dict[int, Any] = {}
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while len(got) < SIZE:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {set(range(SIZE)) - set(got)} gave no result")
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                raise RuntimeError(f"rank(s) {dead} exited")
            try:
                seq, rank, status, value = self.results.get(timeout=1.0)
            except queue.Empty:
                continue
            if seq != self.seq:
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
        return [got[r] for r in range(SIZE)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    with pytest.MonkeyPatch.context() as mp_env:  # the GGUF tokenizer cache, ranks' and ours
        mp_env.setenv("LLMFLEET_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        pool = RankPool()
        yield pool
        pool.close()


def assert_matches_unsplit(ranks: RankPool, case: Case) -> list[tuple[int, int, int]]:
    ref_logits, ref_tokens = run_greedy(case.load())
    out = ranks.run(case)
    for logits, tokens, *_ in out:
        assert_logits_close(logits, ref_logits)
        assert tokens == ref_tokens
    assert torch.equal(out[0][0], out[1][0])  # every rank holds the same full logits
    return [kv for _, _, kv, _ in out]


def test_collectives(ranks: RankPool) -> None:
    both = ([3.0, 30.0], [1.0, 10.0, 2.0, 20.0], [2.0, 20.0])  # sum, rank order, rank 1's
    assert ranks.run("collectives") == [both, both]


def test_dense_llama_checkpoint(ranks: RankPool, make_checkpoint_module) -> None:
    # Uneven vocabulary and intermediate splits; biases of row-parallel o_proj / down_proj.
    path = make_checkpoint_module(
        "llama", vocab_size=261, intermediate_size=97, attention_bias=True, mlp_bias=True
    )
    kv = assert_matches_unsplit(ranks, Case(path=str(path)))
    assert kv == [(1, 2, 0), (1, 2, 1)]


def test_fp8_projections_of_each_rank_give_the_unsplit_fp8_model(
    ranks: RankPool, make_checkpoint_module
) -> None:
    """FP8 under tensor parallelism: each rank quantizes its shard; a row-parallel projection's
    scales cover its own input columns, so its rounding differs from TP=1's, within FP8's."""
    path = make_checkpoint_module(
        "llama", vocab_size=261, intermediate_size=97, attention_bias=True, mlp_bias=True
    )
    case = Case(path=str(path), fp8=True)
    unsplit = case.load()
    row_parallel = {n: m.tp for n, m in unsplit.model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(row_parallel) == 4 * unsplit.spec.num_layers
    assert set(row_parallel.values()) == {None}  # TP=1: nothing to sum
    ref_logits, ref_tokens = run_greedy(unsplit)
    dense_logits, _ = run_greedy(Case(path=str(path)).load())
    out = ranks.run(case)
    assert torch.equal(out[0][0], out[1][0])  # every rank holds the same full logits
    for logits, *_ in out:
        err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        fp8_err = ((ref_logits - dense_logits).norm() / dense_logits.norm()).item()
        assert err < 0.05 and err < 2 * fp8_err, (err, fp8_err)


def test_moe_checkpoints(ranks: RankPool, make_checkpoint_module) -> None:
    # Qwen3-MoE (per-expert gate/up/down, a dense layer, q/k norm) and Mixtral (w1/w2/w3).
    qwen = make_checkpoint_module("qwen3_moe", moe_intermediate_size=45)
    assert_matches_unsplit(ranks, Case(path=str(qwen)))
    assert_matches_unsplit(ranks, Case(path=str(make_checkpoint_module("mixtral"))))


def test_llava_checkpoint(ranks: RankPool) -> None:
    # A vision-language model: its decoder sharded like a text model's, the vision tower and
    # projector replicated (loaded whole from the lazy slices); text prompts.
    kv = assert_matches_unsplit(ranks, Case(path=make_llava_checkpoint("siglip")))
    assert kv == [(1, 2, 0), (1, 2, 1)]


def _stack_experts(src: Path, dst: Path) -> Path:
    """`src` rewritten in transformers-5's stacked expert layout: per layer one
    `mlp.experts.gate_up_proj` (E, 2I, hidden), rows [gate | up], and `down_proj` (E, hidden, I)."""
    per_expert = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if m := per_expert.match(name):
                experts.setdefault((m[1], m[3]), {})[int(m[2])] = f.get_tensor(name)
            else:
                tensors[name] = f.get_tensor(name)
    for (prefix, proj), by_id in experts.items():
        stacked = torch.stack([by_id[e] for e in sorted(by_id)])
        if proj == "down_proj":
            tensors[f"{prefix}.down_proj"] = stacked
        elif proj == "gate_proj":
            up = torch.stack([t for _, t in sorted(experts[(prefix, "up_proj")].items())])
            tensors[f"{prefix}.gate_up_proj"] = torch.cat([stacked, up], dim=1)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_stacked_expert_checkpoint(ranks: RankPool, make_checkpoint_module, tmp_path) -> None:
    src = make_checkpoint_module("qwen3_moe", moe_intermediate_size=45)
    stacked = _stack_experts(src, tmp_path / "stacked")
    per_expert_logits, _ = run_greedy(Case(path=str(src)).load(), steps=1)
    stacked_logits, _ = run_greedy(Case(path=str(stacked)).load(), steps=1)
    assert torch.equal(stacked_logits, per_expert_logits)  # the same weights, either layout
    assert_matches_unsplit(ranks, Case(path=str(stacked)))


def _config(model_type: str, heads: int, kv_heads: int, **extra: Any) -> dict[str, Any]:
    extra.setdefault("vocab_size", 301)
    return dict(
        model_type=model_type,
        architectures=[{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]],
        hidden_size=16 * heads,
        head_dim=16,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        **extra,
    )


@pytest.mark.parametrize("vocab", [300, 301])  # even: gathered in place; odd: padded parts
def test_one_row_logits_into_a_given_buffer(ranks: RankPool, vocab: int) -> None:
    case = Case(config=_config("llama", 4, 2, vocab_size=vocab, tie_word_embeddings=False))
    ref, _ = _row_logits(case.load())
    for returned, into in ranks.run(("row logits", case)):
        assert_logits_close(returned, ref)
        assert torch.equal(into, returned)


def test_uneven_gqa_random_model(ranks: RankPool) -> None:
    # SmolLM2's head shape: 9 query / 3 KV heads split 6+3 / 2+1; tied embeddings.
    case = Case(config=_config("llama", 9, 3, tie_word_embeddings=True))
    assert assert_matches_unsplit(ranks, case) == [(2, 3, 0), (1, 3, 2)]


def test_replicated_kv_head_random_model(ranks: RankPool) -> None:
    # One KV head on both ranks, two query heads each; Qwen3's per-head q/k norm.
    case = Case(config=_config("qwen3", 4, 1, tie_word_embeddings=False))
    assert assert_matches_unsplit(ranks, case) == [(1, 1, 0), (1, 1, 0)]


def test_gguf_q4_projections_stay_packed_on_each_rank(ranks: RankPool, tmp_path) -> None:
    """Packed INT4 under tensor parallelism (the reference kernel on the CPU): each rank keeps
    its part of the Q4 projections packed, a row-parallel one summing over the group, where
    the part falls on the format's groups of 32 input columns. o_proj's 2 heads x 16 = 32
    columns do; down_proj's 96 / 2 = 48 do not, so it is dequantized. Logits and greedy tokens
    are the unsplit packed model's."""
    path = tmp_path / "q4.gguf"
    write_tiny_llama_gguf(build_hf_model("llama"), path, ALL_Q4)
    case = Case(path=str(path), int4=True)
    unsplit = case.load()
    layers = range(unsplit.spec.num_layers)
    projections = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    assert set(packed_int4(unsplit)) == {f"layers.{i}.{p}" for i in layers for p in projections}
    ref_logits, ref_tokens = run_greedy(unsplit)
    out = ranks.run(case)
    for logits, tokens, _, packed in out:
        assert_logits_close(logits, ref_logits)
        assert tokens == ref_tokens
        want = {f"layers.{i}.{p}": p == "self_attn.o_proj" for i in layers for p in projections}
        del want["layers.0.mlp.down_proj"], want["layers.1.mlp.down_proj"]
        assert packed == want


def test_gguf_with_smollm2_heads(ranks: RankPool, tmp_path) -> None:
    # A GGUF llama of SmolLM2's head shape (9 query / 3 KV heads, tied embeddings): its tensors
    # dequantized (Q4/Q8/F16/BF16), q/k rows un-permuted, then cut per rank.
    hf = build_hf_model(
        "llama",
        hidden_size=288,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    path = tmp_path / "smol-shape.gguf"
    write_tiny_llama_gguf(hf, path)
    assert assert_matches_unsplit(ranks, Case(path=str(path))) == [(2, 3, 0), (1, 3, 2)]
