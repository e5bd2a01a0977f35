"""Command-line arguments of `llmfleet bench serve` (defaults follow common serving benches)."""

from __future__ import annotations

import argparse

from llmfleet.cli.benchserve.backends import BACKENDS
from llmfleet.cli.benchserve.datasets import DATASETS

EPILOG = """\
Sends --num-prompts requests from a dataset to a running fleet (gRPC, --endpoint) or an
OpenAI-compatible server (--backend openai|openai-chat, --base-url), arriving as a Poisson
process of --request-rate (gamma with --burstiness), optionally at most --max-concurrency at
once, and prints throughput and TTFT/TPOT/ITL/E2EL statistics. --save-result writes a JSON file
with every aggregate and per-request arrays, a per-request timeline PNG and a latency
distribution PNG into --result-dir.
exit status: 0 every request succeeded, 1 some failed or the server is unreachable,
2 bad arguments.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add `bench serve`'s arguments to `p`."""
    target = p.add_argument_group("target")
    target.add_argument("--backend", default="grpc", choices=BACKENDS)
    target.add_argument(
        "--endpoint",
        default=None,
        help="grpc: fleet address HOST:PORT (default: $LLMFLEET_ENDPOINT or 127.0.0.1:50051)",
    )
    target.add_argument("--base-url", default=None, help="openai*: e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--api-key", default=None, help="the fleet's API key (default: $LLMFLEET_API_KEY)"
    )
    target.add_argument(
        "--endpoint-path",
        default=None,
        help="openai*: default /v1/completions or /v1/chat/completions",
    )
    target.add_argument(
        "--model", default=None, help="openai*: the model field (default: the first served)"
    )
    target.add_argument(
        "--tokenizer",
        default=None,
        help="the served model's checkpoint directory or .gguf, for prompt tokens "
        "(default: the bundled model, as `llmfleet up` serves it)",
    )
    target.add_argument(
        "--request-timeout", type=float, default=None, help="seconds per request (default: none)"
    )

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=DATASETS)
    data.add_argument("--dataset-path", default=None, help="sharegpt: a ShareGPT JSON file")
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]; 0 <= r < 1",
    )
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output tokens per request (default: the reply's token count)",
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    load.add_argument("--num-warmups", type=int, default=0, help="untimed requests first")

    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sampling.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the requested output lengths (default on)",
    )

    out = p.add_argument_group("output")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="metrics to report, comma-separated from ttft,tpot,itl,e2el",
    )
    out.add_argument(
        "--metric-percentiles", default="90,99", help="percentiles, e.g. 50,90,99 (median always)"
    )
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000",
    )
    out.add_argument("--save-result", action="store_true", help="write JSON and plots")
    out.add_argument("--result-dir", default=".", help="where --save-result writes")
    out.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name (default: BACKEND-RATEqps[-concurrencyN]-MODEL-TIME.json); "
        "the plots take its stem plus .timeline.png and .latency.png",
    )
    out.add_argument("--no-plots", action="store_true", help="with --save-result: JSON only")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
