"""`python -m llmfleet.services.worker [flags]`: run a worker until SIGTERM/SIGINT (exit 0).

Flags override `LLMFLEET_WORKER_*` (service) and `LLMFLEET_*` (engine) environment variables
(see shared/core/config.py). On SIGTERM the worker turns NOT_SERVING, deregisters, lets in-flight
requests finish within the grace period (aborting the rest) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

import zmq

from llmfleet.services.worker.server import serve
from llmfleet.shared.core.config import WORKER_ROLES, EngineConfig, WorkerConfig, from_env
from llmfleet.shared.core.errors import LLMFleetError, ValidationError

_WORKER_FLAGS = (
    "host", "port", "metrics_port", "role", "worker_id", "router_address",
    "kvstore_address", "kvstore_endpoint", "kvstore_events_endpoint", "kvstore_put_delay_ms",
    "first_token_yield_ms", "lease_ttl_ms", "kv_push_timeout_ms",
)  # fmt: skip
_ENGINE_FLAGS = (
    "model", "device", "dtype", "block_size", "num_kv_blocks", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "cuda_graph_max_batch_size", "quantization",
    "async_scheduling",
)  # fmt: skip


def parse_config(argv: Sequence[str] | None = None) -> tuple[WorkerConfig, EngineConfig, float]:
    p = argparse.ArgumentParser(
        prog="python -m llmfleet.services.worker",
        description="llmfleet worker: one engine core serving a role (unified, prefill, decode)",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: any)")
    p.add_argument("--role", choices=WORKER_ROLES, help="default unified")
    p.add_argument("--worker-id", help="unique id (default: derived from address and pid)")
    p.add_argument("--router", dest="router_address", help="Registry HOST:PORT")
    p.add_argument("--kvstore", dest="kvstore_address", help="kvstore gRPC HOST:PORT")
    p.add_argument("--kvstore-endpoint", help="kvstore ZMQ data endpoint tcp://HOST:PORT")
    p.add_argument(
        "--kvstore-events",
        dest="kvstore_events_endpoint",
        help="kvstore KV-event endpoint tcp://HOST:PORT (skips lookups it has nothing for)",
    )
    p.add_argument(
        "--kvstore-put-delay-ms",
        type=int,
        help="start prompt-block puts this long after the first token (default 20)",
    )
    p.add_argument(
        "--first-token-yield-ms",
        type=float,
        help="CPU: wait this long after a request's first token before the next step (default 4)",
    )
    p.add_argument("--lease-ttl-ms", type=int, help="default lifetime of KV leases granted here")
    p.add_argument("--kv-push-timeout-ms", type=int, help="prefill: wait this long for acks")
    p.add_argument("--grace-s", type=float, default=10.0, help="drain period on SIGTERM")
    p.add_argument("--model", help="HF checkpoint directory or .gguf file (default: bundled)")
    p.add_argument("--device", help="cpu, cuda, cuda:N")
    p.add_argument("--dtype", help="float32, bfloat16 or float16")
    p.add_argument(
        "--quantization",
        choices=["fp8"],
        help="fp8: quantize the decoder projections to FP8 at load (CUDA sm_89+, 16-bit dtype)",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV block (power of two)")
    p.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks")
    p.add_argument("--max-num-seqs", type=int, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step")
    p.add_argument("--max-model-len", type=int, help="context length cap")
    p.add_argument(
        "--cuda-graph-max-batch-size",
        type=int,
        help="CUDA: replay graphs for decode batches up to this size (default 64; 0: eager)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="CUDA graphs: launch each decode step before the previous one's tokens are read "
        "back (default on)",
    )
    args = vars(p.parse_args(argv))
    try:
        worker = from_env(WorkerConfig, **{k: args[k] for k in _WORKER_FLAGS})
        engine = from_env(EngineConfig, **{k: args[k] for k in _ENGINE_FLAGS})
    except ValidationError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits
    return worker, engine, args["grace_s"]


async def _run(worker: WorkerConfig, engine: EngineConfig, grace_s: float) -> None:
    server = await serve(worker, engine, install_signal_handlers=True, grace_s=grace_s)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    worker, engine, grace_s = parse_config(argv)
    try:
        asyncio.run(_run(worker, engine, grace_s))
    except (LLMFleetError, OSError, zmq.ZMQError) as e:
        logging.getLogger("llmfleet.services.worker").error("worker failed: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
