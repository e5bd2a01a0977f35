"""The fleet on one GPU against the engine alone: a Llama-3-8B-shaped model, the same requests
through the in-process engine and through real fleets on loopback, side by side in one run.

    python3 benchmarks/fleet_gpu_bench.py [--paths aggregated disaggregated] [--concurrency 64 256]
    python3 benchmarks/fleet_gpu_bench.py --tiny    # the same code paths, tiny model, on a CPU

1. Writes (once, under --workdir) a random Llama-3-8B-shaped bf16 checkpoint in 4 safetensors
   shards, with a word-level tokenizer that spells every id of the model's vocabulary (so every
   generated token has text, as with a real model) and a chat template.
2. The requests: `llmfleet bench serve`'s random dataset (--num-prompts prompts of --input-len
   tokens, --output-len tokens out, ignore_eos, greedy), the same token prompts for every path
   (the OpenAI chat path sends their text); each concurrency level its own prompts (seed =
   the level's position in --concurrency), so none runs on the prefix cache another filled.
3. The in-process engine (`LLMEngine`, the workers' engine settings) at each concurrency.
4. `aggregated`: kvstore, tokenizer, router, gateway and one unified worker; `bench serve` over
   gRPC, then through the OpenAI chat gateway, at each concurrency.
5. `disaggregated`: one prefill and one decode worker on the same GPU, each with
   --gpu-memory-utilization 0.45; gRPC at each concurrency.
6. `disaggregated-2gpu`: the prefill worker on GPU 0, the decode worker on GPU 1 (KV moves
   GPU to GPU by CUDA IPC); gRPC at each concurrency. `disaggregated-2gpu-host`: the same with
   `--kv-transfer host` (KV staged through host memory), the baseline of the IPC path.
For the disaggregated paths, the prefill worker's KV pushes at each concurrency: bytes, pushes
GPU to GPU / through host memory, and bytes per second of push time (first send to last ack).
Each row: output tokens/s of the engine and of the fleet, their ratio, ITL and TTFT
percentiles, failed requests.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from e2e_llama3_bench import llama3_8b_config
from fleet_load import HEADER, Load, cpu_seconds, cpu_share, engine_load, row, serve_load
from random_checkpoint import write_random_checkpoint

from llmfleet.cli.benchserve.datasets import HFTokenizer, random_requests
from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.shared.core.config import EngineConfig
from llmfleet.v1 import worker_pb2, worker_pb2_grpc

PROFILE_DELAY_S, PROFILE_S = 10, 10


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", nargs="+", default=["aggregated", "disaggregated"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llmfleet-fleet-gpu-bench"))
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (a smoke test)")
    ap.add_argument("--no-openai", action="store_true", help="aggregated: gRPC only")
    ap.add_argument("--skip-engine", action="store_true", help="fleets only (no table)")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="the engine's token budget per step, for the engine alone and the workers alike "
        "(default: the engine's)",
    )
    ap.add_argument(
        "--profile-dir",
        type=Path,
        help="record each process (and this one, the bench client) with py-spy during each load",
    )
    args = ap.parse_args()
    if args.tiny:
        args.num_prompts, args.input_len, args.output_len = 16, 24, 8
        args.concurrency = [4, 8]
    return args


def write_checkpoint(directory: Path, tiny: bool) -> Path:
    """The random checkpoint and its tokenizer (kept: a later run reuses them)."""
    tiny_sizes = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    config = llama3_8b_config(**(tiny_sizes if tiny else {}))
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    return write_random_checkpoint(directory, config, dtype, device)


def engine_settings(tiny: bool) -> dict[str, Any]:
    return {} if tiny else {"device": "cuda", "dtype": "bfloat16"}


def tuned(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings set by flags, for the engine alone and the workers alike."""
    return (
        {}
        if args.max_num_batched_tokens is None
        else {"max_num_batched_tokens": args.max_num_batched_tokens}
    )


def seed_for(args: argparse.Namespace, concurrency: int) -> int:
    """Each concurrency level draws its own prompts: run after another level with the same
    prompts, it would find them in the prefix cache (engine and workers alike) and measure
    cached prefills."""
    return args.concurrency.index(concurrency)


def workload(args: argparse.Namespace, checkpoint: Path, concurrency: int) -> list[str]:
    return [
        *("--tokenizer", str(checkpoint), "--num-prompts", str(args.num_prompts)),
        *("--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)),
        *("--max-concurrency", str(concurrency), "--seed", str(seed_for(args, concurrency))),
    ]


def run_engine(args: argparse.Namespace, checkpoint: Path) -> dict[int, Load]:
    config = EngineConfig(model=str(checkpoint), **engine_settings(args.tiny), **tuned(args))
    loaded = load_for(config)
    tokenizer = HFTokenizer(loaded.tokenizer, loaded.spec.vocab_size)

    def draw(num: int, seed: int) -> list[list[int]]:
        kw = {"input_len": args.input_len, "output_len": args.output_len}
        return [r.prompt for r in random_requests(tokenizer, num_prompts=num, seed=seed, **kw)]  # type: ignore[misc]

    prompts = {c: draw(args.num_prompts, seed_for(args, c)) for c in args.concurrency}
    engine = LLMEngine(config, loaded)
    engine_load(engine, draw(8, len(args.concurrency)), 4, 8)  # warm-up: prompts no level sends
    out = {c: engine_load(engine, prompts[c], args.output_len, c) for c in args.concurrency}  # type: ignore[arg-type]
    del engine, loaded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_fleet(args: argparse.Namespace, checkpoint: Path, path: str) -> dict[str, dict[int, Load]]:
    settings = engine_settings(args.tiny)
    extra: dict[str, list[str]] = {}
    if path == "disaggregated" and not args.tiny:
        extra["worker"] = ["--gpu-memory-utilization", "0.45"]
    two_gpus = path.startswith("disaggregated-2gpu") and not args.tiny
    if path == "disaggregated-2gpu-host":
        extra["worker"] = ["--kv-transfer", "host"]
    spec = FleetSpec(
        port=0,
        model=str(checkpoint),
        device=settings.get("device"),
        worker_devices=("cuda:0", "cuda:1") if two_gpus else (),
        dtype=settings.get("dtype"),
        engine=tuned(args),
        disaggregated=path.startswith("disaggregated"),
        gateway=path == "aggregated",
        http_port=0,
        extra_args=extra,
        startup_timeout_s=600,
    )
    results: dict[str, dict[int, Load]] = {}
    with Fleet(spec) as fleet:
        targets = {f"{path}, gRPC": ["--endpoint", fleet.endpoint]}
        if path == "aggregated" and not args.no_openai:
            url = str(fleet.http_url)
            targets["aggregated, OpenAI chat"] = ["--backend", "openai-chat", "--base-url", url]
        pids = {c.name: c.proc.pid for c in fleet.children if c.proc is not None}
        pids["bench client"] = os.getpid()
        for name, target in targets.items():
            results[name] = {}
            for c in args.concurrency:
                before, start = cpu_seconds(pids), time.monotonic()
                pushes = kv_pushes(fleet)
                spies = profile(args.profile_dir, f"{name}-c{c}", pids)
                load = serve_load(target, [*workload(args, checkpoint, c), "--num-warmups", "4"])
                if pushes is not None:
                    print(f"{name}, concurrency {c}: {kv_line(pushes, kv_pushes(fleet))}")
                results[name][c] = load
                for spy in spies:
                    spy.wait()
                share = cpu_share(before, cpu_seconds(pids), time.monotonic() - start)
                print(
                    f"{name}, concurrency {c}: {load.tok_s:.0f} tok/s; cores: {share}", flush=True
                )
    return results


def kv_pushes(fleet: Fleet) -> worker_pb2.GetWorkerStatsResponse | None:
    """The prefill worker's KV push totals; None in a fleet without one."""
    prefill = [c for c in fleet.children if c.role == "prefill"]
    if not prefill:
        return None
    with grpc.insecure_channel(prefill[0].address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetWorkerStats(worker_pb2.GetWorkerStatsRequest())


def kv_line(a: worker_pb2.GetWorkerStatsResponse, b: worker_pb2.GetWorkerStatsResponse) -> str:
    nbytes, us = b.kv_pushed_bytes - a.kv_pushed_bytes, b.kv_push_us - a.kv_push_us
    gpu, host = b.kv_pushes_gpu - a.kv_pushes_gpu, b.kv_pushes_host - a.kv_pushes_host
    rate = nbytes / (us / 1e6) / 1e9 if us else 0.0
    mean_ms = us / 1e3 / max(gpu + host, 1)
    return (
        f"KV pushed {nbytes / 1e9:.2f} GB in {gpu + host} pushes ({gpu} GPU to GPU, {host} "
        f"through host memory), {rate:.1f} GB/s of push time, {mean_ms:.2f} ms per push"
    )


def profile(out: Path | None, label: str, pids: dict[str, int]) -> list[subprocess.Popen[bytes]]:
    """`py-spy record` of each process for PROFILE_S seconds (raw collapsed stacks), from
    PROFILE_DELAY_S seconds into the load, in out/<label>-<process>.txt; none without `out`."""
    if out is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    tag = label.replace(" ", "").replace(",", "-")
    return [
        subprocess.Popen(
            f"sleep {PROFILE_DELAY_S}; exec py-spy record -p {pid} -d {PROFILE_S} -r 200 -f raw "
            f"-o {out / (tag + '-' + proc.replace(' ', '-') + '.txt')} >/dev/null 2>&1",
            shell=True,
        )
        for proc, pid in pids.items()
    ]


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    checkpoint = write_checkpoint(args.workdir / ("tiny" if args.tiny else "llama3-8b"), args.tiny)
    print(f"checkpoint {checkpoint} ({time.monotonic() - started:.0f} s)", flush=True)
    engine = {} if args.skip_engine else run_engine(args, checkpoint)
    for c, load in engine.items():
        print(f"engine, concurrency {c}: {load.tok_s:.0f} tok/s", flush=True)
    fleets: dict[str, dict[int, Load]] = {}
    for path in args.paths:
        fleets.update(run_fleet(args, checkpoint, path))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine()
    print(
        f"\n# the fleet vs the engine alone — {time.strftime('%Y-%m-%d')}, {device}, torch "
        f"{torch.__version__}; {'tiny model' if args.tiny else 'Llama-3-8B shape, bf16'}, "
        f"{args.num_prompts} requests of {args.input_len} + {args.output_len} tokens; "
        f"engine settings {tuned(args) or 'default'}; "
        f"{time.monotonic() - started:.0f} s in all"
    )
    print(HEADER)
    for name, by_conc in fleets.items():
        for c, load in by_conc.items():
            if c in engine:
                print(row(f"{name}, concurrency {c}", engine[c], load))


if __name__ == "__main__":
    main()
