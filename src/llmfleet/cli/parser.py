"""The `llmfleet` command line's arguments: `build_parser` and the groups its subcommands share
(engine choice and endpoint, sampling, the fleet's shape for `up`). Parsing only: what the
arguments mean is in `generate` and `up`, and `bench serve`'s are in `benchserve.args`.
"""

from __future__ import annotations

import argparse

from llmfleet.cli.benchserve import args as bench_args
from llmfleet.cli.generate import ENGINE_FLAGS
from llmfleet.cli.services import SERVICES
from llmfleet.services.tokenizer.flags import add_media_flags
from llmfleet.shared.core.api_keys import add_api_key_flag
from llmfleet.shared.core.config import ROUTING_POLICIES
from llmfleet.shared.core.engine_flags import TP_GROUP_FLAGS, add_engine_flags

_GENERATE_EPILOG = """\
output: the completion's text and a newline. With --n N > 1, each completion is preceded by a
line `--- completion I ---` (I = 0 .. N-1), in index order; --stream prints the same bytes as
they are generated (completion I+1 appears once completion I has finished).
--logprobs K: one JSON object per generated token on stderr, e.g.
{"completion": 0, "position": 0, "token_id": 504, "logprob": -0.12, "rank": 1,
 "top": [{"token_id": 504, "logprob": -0.12}, ...]}
exit status: 0 ok, 1 fleet unreachable or failed, 2 bad input, 130 interrupted.
"""


def _mode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint",
        default=None,
        help="fleet address HOST:PORT (default: $LLMFLEET_ENDPOINT or 127.0.0.1:50051)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per request")
    p.add_argument(
        "--api-key", default=None, help="the fleet's API key (default: $LLMFLEET_API_KEY)"
    )
    p.add_argument("--offline", action="store_true", help="run the engine in this process")
    p.add_argument(
        "--model", help="--offline: HF checkpoint directory or .gguf file (default: bundled)"
    )
    p.add_argument("--device", default=None, help="--offline: cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization", default=None, choices=["fp8"], help="--offline: FP8 weights (CUDA)"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="--offline: split the model over N ranks (processes; CUDA: cuda:0..N-1)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host", default="127.0.0.1", help="address of the public ports (router, gateway)"
    )
    p.add_argument(
        "--internal-host",
        default="127.0.0.1",
        help="address of every internal port (tokenizer, kvstore, workers, the router's "
        "Registry; default 127.0.0.1)",
    )
    p.add_argument(
        "--tls-dir",
        default=None,
        help="mutual TLS and CURVE on internal traffic with these credentials "
        "(make them with `llmfleet tls init DIR`); default: plaintext",
    )
    p.add_argument("--port", type=int, default=50051, help="public (router) port; 0: any")
    p.add_argument("--disaggregated", action="store_true", help="prefill and decode workers")
    p.add_argument("--workers", type=int, default=None, help="unified workers (default 1)")
    p.add_argument("--prefill-workers", type=int, default=None, help="default 1")
    p.add_argument("--decode-workers", type=int, default=None, help="default 1")
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: bundled)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument(
        "--worker-devices",
        nargs="+",
        default=None,
        metavar="DEVICE",
        help="one device per worker, prefill workers first (e.g. --disaggregated "
        "--worker-devices cuda:0 cuda:1: prefill on GPU 0, decode on GPU 1); default: --device",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization", default=None, choices=["fp8"], help="workers serve FP8 weights (CUDA)"
    )
    p.add_argument("--routing-policy", default=None, choices=list(ROUTING_POLICIES))
    p.add_argument("--no-kvstore", action="store_true", help="run without the shared KV store")
    p.add_argument(
        "--no-gateway", action="store_true", help="run without the OpenAI-compatible HTTP gateway"
    )
    p.add_argument("--http-port", type=int, default=8000, help="the gateway's port; 0: any")
    add_api_key_flag(
        p,
        "a key callers of the router and gateway must send (repeatable; default: "
        "$LLMFLEET_API_KEYS; none: open); the client sends SECRET",
    )
    p.add_argument("--log-dir", default=None, help="children's logs (default: a temp dir)")
    p.add_argument("--quiet", action="store_true", help="do not copy children's logs to stderr")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    p.add_argument(
        "--grace-s", type=float, default=30.0, help="on stop: open streams finish for this long"
    )
    p.add_argument(
        "--no-restart", action="store_true", help="a child that exits stops the fleet (no restart)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve child restart counts here (0: any)"
    )
    p.add_argument(
        "--metrics-port-base",
        type=int,
        default=None,
        metavar="BASE",
        help="the services' /metrics ports: kvstore BASE, tokenizer BASE+1, router BASE+2, "
        "gateway BASE+3, worker i BASE+4+i (default: free ports; each is printed)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    engine = p.add_argument_group("the workers' engine (see python -m llmfleet.services.worker)")
    add_engine_flags(engine, skip=(*ENGINE_FLAGS, *TP_GROUP_FLAGS))
    add_media_flags(p.add_argument_group("images, for a vision-language model (the tokenizer's)"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmfleet", description="The `llmfleet` command line.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="complete one prompt and print the completion",
        epilog=_GENERATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _mode_args(gen)
    _sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--n", type=int, default=1, help="completions of the prompt (default 1)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K", help="see below")
    gen.add_argument("prompt")
    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    _mode_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    up = sub.add_parser(
        "up",
        help="start a fleet on this machine; Ctrl-C stops it",
        description="Start kvstore, tokenizer, router, workers and the OpenAI-compatible "
        "HTTP gateway as child processes, print `llmfleet: serving on HOST:PORT` (and the "
        "gateway's URL on the next line, then `llmfleet: metrics of NAME on URL` per service) "
        "once every one is SERVING, stop them on SIGINT/SIGTERM.",
    )
    _up_args(up)
    up.add_argument(
        "--chat",
        action="store_true",
        help="once serving, chat with the fleet on this terminal; the fleet stops when the "
        "chat ends (an empty line or Ctrl-D)",
    )
    up.add_argument("--system", default=None, help="--chat: system message")
    up.add_argument("--timeout", type=float, default=None, help="--chat: seconds per reply")
    _sampling_args(up)
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser(
        "serve",
        help="serving benchmark: throughput, TTFT/TPOT/ITL/E2EL, goodput, plots",
        epilog=bench_args.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_args.add_arguments(serve)
    tls = sub.add_parser("tls", help="credentials for the fleet's internal traffic")
    tls_sub = tls.add_subparsers(dest="tls_command", required=True)
    init = tls_sub.add_parser(
        "init",
        help="make a development CA, a fleet certificate and a CURVE keypair in DIR",
        description="Write DIR/ca.crt, DIR/ca.key, DIR/fleet.crt, DIR/fleet.key and "
        "DIR/curve/fleet.key{,_secret}: what `llmfleet up --tls-dir DIR` and every service's "
        "--tls-dir read (mutual TLS on internal gRPC, CURVE on ZMQ). Prints the files written.",
    )
    init.add_argument("dir", help="directory to create (must not hold credentials already)")
    init.add_argument("--days", type=int, default=365, help="validity (default 365)")
    init.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    # `llmfleet <service> ARGS...` is dispatched by `main` before this parser sees it (its
    # arguments are the service's own); listed here for `llmfleet --help`.
    for name, summary in SERVICES.items():
        sub.add_parser(name, add_help=False, help=f"{summary} (`llmfleet {name} --help`)")
    return parser
