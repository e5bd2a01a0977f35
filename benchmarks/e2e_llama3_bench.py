"""End to end on one GPU: a Llama-3-8B-shaped model through our engine vs the roofline and HF.

    make bench-gpu            # or: python3 benchmarks/e2e_llama3_bench.py [--out PATH]
    python3 benchmarks/e2e_llama3_bench.py --tiny   # the same code paths, tiny model, CPU

One run measures, in order:
  1. device-to-device copy bandwidth (a large torch copy; bytes read + written per second);
  2. our engine (`LLMEngine`, CUDA graphs on) on random bf16 weights built directly on the
     GPU (`loader.random_model`, no checkpoint, no tokenizer): the median interval between
     steps that hand every sequence a decode token (after a warm-up) for one sequence at a
     short context and for 64 sequences at context ~1024, with async scheduling (the
     default) and without it ("sync"), two runs each, interleaved;
  3. offline throughput: 256 requests, input and output lengths uniform in 100-1024
     (seeded), ignore_eos, all added at once; output tokens/s (capped by --offline-limit-s:
     the figure is then partial and says so);
  4. our model freed, then transformers' LlamaForCausalLM (random bf16, sdpa) through
     `generate` on the same workloads: ms per decode step = the difference of two greedy
     runs of different lengths divided by the extra tokens (so prefill cancels out).
Roofline of a decode step = (bytes of the weights a step reads + KV bytes read) / copy
bandwidth. The weights a step reads are all parameters but the input embedding (it reads one
row per token); the KV read is batch x mean context x KV bytes per token.
Targets: batch 1 <= 1.2x the roofline, batch 64 <= 1.25x (>= 0.8x its speed).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, replace

import torch
from decode_timing import (
    copy_bandwidth,
    engine_decode_ms,
    random_prompts,
    sync,
    weight_bytes_per_step,
    with_async,
)
from transformers import LlamaConfig, LlamaForCausalLM

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import random_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

GiB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """Sizes of one run; FULL is the issue's workload, TINY the same paths in seconds on CPU."""

    config: LlamaConfig
    device: str
    dtype: str
    copy_bytes: int  # bytes of the copied tensor
    single_prompt: int  # batch-1 decode: prompt length
    single_steps: int
    batch: int  # batched decode at context ~ batch_prompt + batch_steps / 2
    batch_prompt: int
    batch_steps: int
    warmup_steps: int
    offline_requests: int
    offline_lo: int  # input and output lengths uniform in [lo, hi]
    offline_hi: int
    max_num_seqs: int
    graph_max_batch: int
    kv_headroom_bytes: int  # GPU memory left free next to the KV cache
    hf_single_tokens: tuple[int, int]  # two generate lengths; the difference gives ms/step
    hf_batch_tokens: tuple[int, int]


def llama3_8b_config(**overrides) -> LlamaConfig:
    fields = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


# The workload the targets are stated for: Llama-3-8B's shape in bf16 on one GPU.
# fmt: off
FULL = Plan(
    config=llama3_8b_config(), device="cuda", dtype="bfloat16", copy_bytes=4 * GiB,
    single_prompt=128, single_steps=64, batch=64, batch_prompt=1008, batch_steps=32,
    warmup_steps=4, offline_requests=256, offline_lo=100, offline_hi=1024, max_num_seqs=256,
    graph_max_batch=256, kv_headroom_bytes=10 * GiB, hf_single_tokens=(8, 40),
    hf_batch_tokens=(4, 20),
)
# fmt: on
# The same code paths in seconds on a CPU: FULL with every size scaled down.
# fmt: off
TINY = replace(
    FULL, device="cpu", dtype="float32", copy_bytes=1 << 24, kv_headroom_bytes=0,
    single_prompt=16, single_steps=6, batch=4, batch_prompt=40, batch_steps=6, warmup_steps=2,
    offline_requests=6, offline_lo=5, offline_hi=30, max_num_seqs=8, graph_max_batch=8,
    hf_single_tokens=(2, 8), hf_batch_tokens=(2, 8),
    config=llama3_8b_config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    ),
)
# fmt: on


@dataclass
class Offline:
    requests: int
    finished: int
    output_tokens: int
    prompt_tokens: int
    seconds: float
    steps: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds


def offline_throughput(engine: LLMEngine, plan: Plan, limit_s: float, seed: int = 0) -> Offline:
    """Add `plan.offline_requests` requests at once and step until all finish or `limit_s`
    passes (then the figure covers the tokens made so far)."""
    rng = random.Random(seed)
    vocab = engine.spec.vocab_size
    prompt_tokens = 0
    start = time.perf_counter()
    for i in range(plan.offline_requests):
        n_in = rng.randint(plan.offline_lo, plan.offline_hi)
        n_out = rng.randint(plan.offline_lo, plan.offline_hi)
        prompt_tokens += n_in
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        engine.add_request(f"off-{i}", [rng.randrange(vocab) for _ in range(n_in)], params)
    out_tokens = finished = steps = 0
    while engine.has_unfinished() and time.perf_counter() - start < limit_s:
        for o in engine.step():
            out_tokens += len(o.new_token_ids)
            finished += o.finished
        steps += 1
    seconds = time.perf_counter() - start
    return Offline(plan.offline_requests, finished, out_tokens, prompt_tokens, seconds, steps)


def hf_decode_ms(model: LlamaForCausalLM, prompts: list[list[int]], lengths: tuple[int, int]):
    """ms per decode step of greedy `generate`: (t(long) - t(short)) / (long - short), each
    time the fastest of three runs (on a small CPU model, noise would otherwise swamp the
    difference, even to below zero)."""
    device = str(model.device)
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        sync(device)
        assert out.shape == (len(prompts), ids.shape[1] + n), out.shape
        return time.perf_counter() - start

    timed(2)  # warm-up
    short, long = lengths
    return (
        1e3
        * (min(timed(long) for _ in range(3)) - min(timed(short) for _ in range(3)))
        / (long - short)
    )


def build_engine(plan: Plan):
    """Our random-weight model and an engine whose KV cache holds every offline request at
    once where memory allows (GPU: what is free after the weights, less the headroom)."""
    from llmfleet.engine.model_runner import kv_bytes_per_block

    cfg = EngineConfig(
        device=plan.device,
        dtype=plan.dtype,
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=8192,
        cuda_graph_max_batch_size=plan.graph_max_batch,
    )
    loaded = random_model(plan.config, dtype=cfg.torch_dtype, device=plan.device, seed=0)
    max_len = max(
        2 * plan.offline_hi,
        plan.batch_prompt + plan.batch_steps,
        plan.single_prompt + plan.single_steps,
    )
    per_block = kv_bytes_per_block(loaded.spec, cfg.block_size, cfg.torch_dtype)
    blocks = plan.max_num_seqs * -(-max_len // cfg.block_size)
    if torch.device(plan.device).type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        blocks = min(blocks, (free - plan.kv_headroom_bytes) // per_block)
    cfg = replace(cfg, num_kv_blocks=int(blocks), max_model_len=max_len)
    start = time.perf_counter()
    engine = LLMEngine(cfg, loaded)
    return engine, time.perf_counter() - start


@dataclass
class Results:
    device: str
    copy_bw: float  # bytes/s
    weight_bytes: int
    kv_per_token: int
    start_s: float  # engine start-up (KV cache, graph capture)
    graphs: bool
    kv_blocks: int
    ours: dict[str, float]  # workload -> ms per step
    ours_sync: dict[str, float]  # the same with async scheduling off
    roofline: dict[str, float]  # workload -> ms per step
    hf: dict[str, float]
    offline: Offline


def run(plan: Plan, offline_limit_s: float, log=print) -> Results:
    cfg = plan.config
    dev = plan.device
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    log(f"{device_name}, torch {torch.__version__}")
    bw = copy_bandwidth(dev, plan.copy_bytes)
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    engine, start_s = build_engine(plan)
    weights = weight_bytes_per_step(engine.model)
    kvpt = engine.model_shape.kv_bytes_per_token
    log(f"engine up in {start_s:.1f} s; weights read per step {weights / 1e9:.2f} GB")
    workloads = {
        f"decode b=1 ctx~{plan.single_prompt + plan.single_steps // 2}": (
            random_prompts(1, plan.single_prompt, cfg.vocab_size, 1),
            plan.single_steps,
            plan.hf_single_tokens,
        ),
        f"decode b={plan.batch} ctx~{plan.batch_prompt + plan.batch_steps // 2}": (
            random_prompts(plan.batch, plan.batch_prompt, cfg.vocab_size, 2),
            plan.batch_steps,
            plan.hf_batch_tokens,
        ),
    }
    ours, ours_sync, roof, hf = {}, {}, {}, {}
    for name, (prompts, steps, _) in workloads.items():
        engine_decode_ms(engine, [p[:32] for p in prompts], plan.warmup_steps)
        runs: dict[bool, list[float]] = {True: [], False: []}
        for on in (True, False, True, False):  # interleaved: drift hits both sides alike
            with_async(engine, on)
            runs[on].append(engine_decode_ms(engine, prompts, steps))
        with_async(engine, True)
        ours[name] = statistics.mean(runs[True])
        ours_sync[name] = statistics.mean(runs[False])
        ctx = len(prompts[0]) + steps / 2
        roof[name] = 1e3 * (weights + len(prompts) * ctx * kvpt) / bw
        log(
            f"{name}: ours {ours[name]:.2f} ms/step (async scheduling off "
            f"{ours_sync[name]:.2f}), roofline {roof[name]:.2f} ms"
        )
    offline = offline_throughput(engine, plan, offline_limit_s)
    log(f"offline: {offline.output_tok_s:.0f} output tok/s ({offline.finished} finished)")
    graphs = engine.runner.decode_graphs is not None
    kv_blocks = engine.block_manager.num_blocks
    del engine
    if dev == "cuda":
        torch.cuda.empty_cache()
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(
            cfg, dtype=getattr(torch, plan.dtype), attn_implementation="sdpa"
        ).eval()
    for name, (prompts, _, lengths) in workloads.items():
        with torch.inference_mode():
            hf[name] = hf_decode_ms(model, prompts, lengths)
        log(f"{name}: transformers {hf[name]:.2f} ms/step")
    del model
    return Results(
        device_name, bw, weights, kvpt, start_s, graphs, kv_blocks, ours, ours_sync, roof, hf,
        offline,
    )  # fmt: skip


def table(r: Results, plan: Plan) -> str:
    lines = [
        f"device {r.device}; torch {torch.__version__}; copy bandwidth {r.copy_bw / 1e9:.0f} GB/s "
        f"(read+write); weights read per step {r.weight_bytes / 1e9:.2f} GB; "
        f"KV {r.kv_per_token / 1024:.0f} KiB/token; engine start {r.start_s:.1f} s "
        f"(CUDA graphs {'on' if r.graphs else 'off'}, {r.kv_blocks} KV blocks)",
        f"{'workload':22s} {'roofline ms':>11s} {'ours ms':>8s} {'ours/roof':>9s} "
        f"{'sync ms':>8s} {'sync/roof':>9s} {'HF ms':>8s} {'HF/roof':>8s} {'HF/ours':>8s}",
    ]
    for name, roof in r.roofline.items():
        ours, sync, hf = r.ours[name], r.ours_sync[name], r.hf[name]
        lines.append(
            f"{name:22s} {roof:11.2f} {ours:8.2f} {ours / roof:8.2f}x "
            f"{sync:8.2f} {sync / roof:8.2f}x {hf:8.2f} {hf / roof:7.1f}x {hf / ours:7.1f}x"
        )
    o = r.offline
    partial = "" if o.finished == o.requests else f" (PARTIAL: {o.finished} finished)"
    lines.append(
        f"offline {o.requests} requests, in/out U[{plan.offline_lo},{plan.offline_hi}], "
        f"ignore_eos: {o.output_tok_s:.0f} output tok/s, "
        f"{(o.output_tokens + o.prompt_tokens) / o.seconds:.0f} total tok/s, "
        f"{o.output_tokens} output tokens in {o.seconds:.1f} s, {o.steps} steps{partial}"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (a smoke test)")
    ap.add_argument("--offline-limit-s", type=float, default=150.0)
    ap.add_argument("--out", help="also write the table (and the log) to this file")
    args = ap.parse_args()
    plan = TINY if args.tiny else FULL
    log_lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_lines.append(msg)

    text = table(run(plan, args.offline_limit_s, log), plan)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join([*log_lines, text, ""]))


if __name__ == "__main__":
    main()
