"""Tensor parallelism on several GPUs: a Llama-3-8B-shaped model at TP=1 and TP=N, side by side.

    python3 benchmarks/tp_decode_bench.py [--tp 2] [--workdir DIR]
    python3 benchmarks/tp_decode_bench.py --tiny     # the same code paths, tiny model, CPU (gloo)

One run, in order:
  1. each GPU's device-to-device copy bandwidth (bytes read + written per second);
  2. correctness in float32: a 2-layer model of the Llama-3-8B shape (random weights, a real
     checkpoint on disk), greedy tokens of a few prompts at TP=N against TP=1 (must be equal);
  3. the full Llama-3-8B shape in bf16 (random checkpoint, 4 safetensors shards): batch-1 and
     batch-16 decode, the median inter-token interval of the engine (`LLMEngine`, CUDA graphs,
     as served: TP=1, TP=N, and on GPUs TP=N with every sum on NCCL, `--tp-all-reduce nccl`),
     and how many of the greedy tokens TP=N shares with TP=1 before the first difference (bf16
     sums in another order: a difference is not a bug there, which is why step 2 checks
     equality in float32);
  4. (`--big`) a Llama-3-70B-shaped model at TP=N with random weights (`--load-format dummy`:
     config and a word-level tokenizer on disk, no weight files): loads, decodes, batch-1 step
     time against its roofline. Its vocabulary has the bundled model's size (49152), the rest
     is 70B's.
Roofline of a batch-1 decode step at TP=N: the bytes of the weights a step reads divided by N
copy bandwidths (each GPU reads its shard); its all-reduces are not in it. Target (issue 30):
TP=2 batch-1 decode <= 1.3x that roofline.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import signal
import statistics
import time
from pathlib import Path

import torch
from decode_timing import copy_bandwidth, engine_decode_ms, random_prompts, weight_bytes_per_step
from e2e_llama3_bench import llama3_8b_config
from random_checkpoint import write_random_checkpoint, write_weightless_checkpoint

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

GiB = 1 << 30
BIG_VOCAB = 49152  # the 70B shape's vocabulary: the bundled model's size (its LM head's rows)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
)  # fmt: skip


def engine(checkpoint: Path, tp: int, device: str, dtype: str, **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(checkpoint), device=device, dtype=dtype, tensor_parallel_size=tp, **kw
    )
    return LLMEngine(config, load_for(config))


def greedy(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    tag = time.monotonic_ns()
    for i, p in enumerate(prompts):
        eng.add_request(f"g{tag}-{i}", p, params)
    while eng.has_unfinished():
        for o in eng.step():
            out[int(o.request_id.rsplit("-", 1)[1])].extend(o.new_token_ids)
    return [out[i] for i in range(len(prompts))]


def with_engine(checkpoint: Path, tp: int, device: str, dtype: str, fn, **kw):
    """fn(engine) on a fresh engine, which is closed and freed (its KV cache, its ranks)
    before the next one is made."""
    eng = engine(checkpoint, tp, device, dtype, **kw)
    try:
        return fn(eng)
    finally:
        eng.close()
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def profile(args: argparse.Namespace, work: Path, device: str, sizes: dict) -> None:
    """torch.profiler over 16 batch-1 decode steps of rank 0 at TP=N: the top operations by
    self CPU time and by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    gpu = device == "cuda"
    torch_dtype = torch.bfloat16 if gpu else torch.float32
    name = "tiny" if args.tiny else "llama3-8b"
    big = write_random_checkpoint(work / name, llama3_8b_config(**sizes), torch_dtype, device)
    vocab = llama3_8b_config(**sizes).vocab_size - 8
    one = random_prompts(1, 128, vocab, seed=2)

    def run(eng: LLMEngine) -> None:
        engine_decode_ms(eng, one, 16)  # warm-up
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with torch_profile(activities=acts) as prof:
            ms = engine_decode_ms(eng, one, 16)
        print(f"TP={args.tp} batch-1 decode: {ms:.2f} ms per step (profiled)")
        avg = prof.key_averages()
        print(avg.table(sort_by="self_cpu_time_total", row_limit=25))
        if gpu:
            print(avg.table(sort_by="self_cuda_time_total", row_limit=15))
        if args.trace:
            prof.export_chrome_trace(args.trace)

    with_engine(big, args.tp, device, str(torch_dtype).removeprefix("torch."), run)


def llama3_70b_dir(work: Path) -> Path:
    """A checkpoint directory of the Llama-3-70B shape without weights: config and tokenizer."""
    config = llama3_8b_config(
        vocab_size=BIG_VOCAB, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
    )  # fmt: skip
    return write_weightless_checkpoint(work / "llama3-70b-dummy", config)


def big_model(args: argparse.Namespace, work: Path, bw: list[float]) -> list[tuple[str, str]]:
    """Step 4: the 70B shape at TP=N, random weights."""
    path = Path(args.big_dir) if args.big_dir else llama3_70b_dir(work)
    one = random_prompts(1, 128, BIG_VOCAB - 8, seed=4)
    start = time.perf_counter()

    def measure(eng: LLMEngine) -> tuple[float, float, float]:
        loaded_s = time.perf_counter() - start
        weights = float(weight_bytes_per_step(eng.runner.model)) * args.tp  # rank 0's x N
        return loaded_s, weights, engine_decode_ms(eng, one, 32)

    loaded_s, weights, b1 = with_engine(
        path, args.tp, "cuda", "bfloat16", measure, load_format="dummy"
    )
    roof = 1e3 * weights / (args.tp * statistics.mean(bw[: args.tp]))
    return [
        (f"70B shape TP={args.tp}: load (dummy) + start", f"{loaded_s:.0f} s"),
        (
            f"70B shape TP={args.tp} batch-1 decode",
            f"{b1:.2f} ms; roofline {roof:.2f} ms, at {b1 / roof:.2f}x; "
            f"weights {weights / GiB:.0f} GiB",
        ),
    ]


def check_fp32(args: argparse.Namespace, work: Path, device: str, sizes: dict) -> tuple[str, str]:
    """Step 2: float32 greedy tokens at TP=N against TP=1, on 2 layers of the shape."""
    small = write_random_checkpoint(
        work / ("fp32-tiny" if args.tiny else "fp32-2layer"),
        llama3_8b_config(**{**sizes, "num_hidden_layers": 2}),
        torch.float32,
        device,
    )
    vocab = llama3_8b_config(**sizes).vocab_size - 8
    prompts = random_prompts(4, 48, vocab, seed=1)
    ref = with_engine(small, 1, device, "float32", lambda e: greedy(e, prompts, 24))
    got = with_engine(small, args.tp, device, "float32", lambda e: greedy(e, prompts, 24))
    equal = sum(a == b for a, b in zip(ref, got, strict=True))
    return (f"float32 greedy TP={args.tp} == TP=1", f"{equal}/{len(prompts)} prompts")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--workdir", default="/tmp/llmfleet-tp-bench")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timing run")
    p.add_argument("--profile", action="store_true", help="only: profile TP=N batch-1 decode")
    p.add_argument("--trace", help="with --profile: write the Chrome trace (JSON) here")
    p.add_argument("--big", action="store_true", help="also: the 70B shape at TP=N (dummy)")
    p.add_argument("--only-big", action="store_true", help="only step 4 (with step 1)")
    p.add_argument("--only-check", action="store_true", help="only step 2 (with step 1)")
    p.add_argument("--skip-check", action="store_true", help="leave out step 2")
    p.add_argument(
        "--skip-tp1",
        action="store_true",
        help="step 3 without TP=1 (the roofline from TP=N's shard; no token comparison)",
    )
    p.add_argument(
        "--variants",
        nargs="*",
        default=["nccl"],
        choices=["nccl"],
        help="GPUs: also time TP=N with every sum on NCCL (give none to leave it out)",
    )
    p.add_argument("--big-dir", help="step 4's checkpoint directory (default: written here)")
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks of a hung run
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s rank-0 %(name)s: %(message)s"
    )
    work = Path(args.workdir)
    gpu = torch.cuda.is_available() and not args.tiny
    device = "cuda" if gpu else "cpu"
    sizes = TINY if args.tiny else {}

    if args.profile:
        return profile(args, work, device, sizes)
    rows: list[tuple[str, str]] = []
    bw = []
    if gpu:
        for r in range(args.tp):
            bw.append(copy_bandwidth(f"cuda:{r}", 2 * GiB))
            rows.append((f"copy bandwidth cuda:{r}", f"{bw[-1] / 1e9:.0f} GB/s"))

    if args.only_big:
        return print_rows(rows + big_model(args, work, bw), "")
    vocab = llama3_8b_config(**sizes).vocab_size - 8
    if not args.skip_check:
        rows.append(check_fp32(args, work, device, sizes))
        print(*rows, sep="\n", flush=True)  # so far, in case a later step fails
    if args.only_check:
        return print_rows(rows, "tiny on CPU" if args.tiny else "")

    # 3. the full shape in bf16 (tiny: float32)
    dtype, torch_dtype = ("bfloat16", torch.bfloat16) if gpu else ("float32", torch.float32)
    name = "tiny" if args.tiny else "llama3-8b"
    big = write_random_checkpoint(work / name, llama3_8b_config(**sizes), torch_dtype, device)
    one = random_prompts(1, 128, vocab, seed=2)
    batch = random_prompts(16, 128, vocab, seed=3)
    results: dict[str, dict] = {}

    def measure(eng: LLMEngine) -> dict[str, float | list[list[int]]]:
        model = getattr(eng.runner, "model", None)
        return {
            "weights": float(weight_bytes_per_step(model)) if model is not None else 0.0,
            "tokens": greedy(eng, batch[:4], 32),
            "b1": statistics.median(engine_decode_ms(eng, one, args.steps) for _ in range(3)),
            "b16": engine_decode_ms(eng, batch, args.steps),
        }

    # TP=N as served, and (GPUs) with every sum on NCCL: the one-shot all-reduce's gain
    runs = [] if args.skip_tp1 else [("TP=1", 1, "auto")]
    runs.append((f"TP={args.tp}", args.tp, "auto"))
    if gpu and "nccl" in args.variants:
        runs.append((f"TP={args.tp}, NCCL sums", args.tp, "nccl"))
    for label, tp, sums in runs:
        results[label] = with_engine(big, tp, device, dtype, measure, tp_all_reduce=sums)
        print(f"{label}: batch 1 {results[label]['b1']:.2f} ms", flush=True)
    # The weights of a TP=1 step; without that run, rank 0's shard x N (the norms, replicated
    # on every rank, are then counted N times: under 0.01% of the Llama-3-8B shape's bytes).
    first = runs[0]
    full_weights = results[first[0]]["weights"] * first[1]
    for label, tp, _ in runs:
        r = results[label]
        line = f"batch 1 {r['b1']:.2f} ms, batch 16 {r['b16']:.2f} ms"
        if gpu:
            roof = 1e3 * full_weights / (tp * statistics.mean(bw[:tp]))
            line += f"; roofline {roof:.2f} ms, batch 1 at {r['b1'] / roof:.2f}x"
        rows.append((f"{dtype} {label} decode", line))
    if not args.skip_tp1:
        for label, _, _ in runs[1:]:
            pairs = zip(results["TP=1"]["tokens"], results[label]["tokens"], strict=True)
            same = [shared_prefix(a, b) for a, b in pairs]
            rows.append((f"{dtype} {label} greedy tokens shared with TP=1 (of 32)", str(same)))
        speedup = results["TP=1"]["b1"] / results[f"TP={args.tp}"]["b1"]
        rows.append(("speed-up of batch-1 decode", f"{speedup:.2f}x"))
    rows.append(("weights read per step (TP=1)", f"{full_weights / GiB:.2f} GiB"))
    if args.big and gpu:
        rows += big_model(args, work, bw)
    print_rows(rows, "tiny on CPU" if args.tiny else "")


def print_rows(rows: list[tuple[str, str]], where: str) -> None:
    print(f"\n== tensor parallelism, {where or torch.cuda.get_device_name()}")
    for k, v in rows:
        print(f"{k:<46} {v}")


if __name__ == "__main__":
    main()
