"""The `llmfleet` command line.

    llmfleet up [--disaggregated] [--workers N] [--port 50051] [--http-port 8000] [--model PATH] ...
    llmfleet generate [--endpoint HOST:PORT] [--raw] [--max-tokens N] [--n N] [--stream] PROMPT
    llmfleet chat [--endpoint HOST:PORT] [--system TEXT]
    llmfleet generate --offline ... PROMPT       (the engine in this process, no fleet)
    llmfleet bench serve [--backend grpc|openai|openai-chat] [--dataset-name ...] ...

`generate` and `chat` talk gRPC to a fleet (`--endpoint`, else `LLMFLEET_ENDPOINT`, else
127.0.0.1:50051); `--offline` runs the engine in this process instead. Only completions go to
stdout; logs, logprobs and errors go to stderr. Exit status: 0 ok; 1 the fleet is unreachable
or failed; 2 bad input (the message names the parameter); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Sequence
from typing import IO, Any

from llmfleet.cli.benchserve import args as bench_args
from llmfleet.shared.core.errors import LLMFleetError, ValidationError

logger = logging.getLogger("llmfleet")

_GENERATE_EPILOG = """\
output: the completion's text and a newline. With --n N > 1, each completion is preceded by a
line `--- completion I ---` (I = 0 .. N-1), in index order; --stream prints the same bytes as
they are generated (completion I+1 appears once completion I has finished).
--logprobs K: one JSON object per generated token on stderr, e.g.
{"completion": 0, "position": 0, "token_id": 504, "logprob": -0.12, "rank": 1,
 "top": [{"token_id": 504, "logprob": -0.12}, ...]}
exit status: 0 ok, 1 fleet unreachable or failed, 2 bad input, 130 interrupted.
"""


# ---- arguments ----------------------------------------------------------------------------


def _mode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint",
        default=None,
        help="fleet address HOST:PORT (default: $LLMFLEET_ENDPOINT or 127.0.0.1:50051)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per request")
    p.add_argument("--offline", action="store_true", help="run the engine in this process")
    p.add_argument(
        "--model", help="--offline: HF checkpoint directory or .gguf file (default: bundled)"
    )
    p.add_argument("--device", default=None, help="--offline: cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization", default=None, choices=["fp8"], help="--offline: FP8 weights (CUDA)"
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
    p.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p.add_argument("--port", type=int, default=50051, help="public (router) port; 0: any")
    p.add_argument("--disaggregated", action="store_true", help="prefill and decode workers")
    p.add_argument("--workers", type=int, default=None, help="unified workers (default 1)")
    p.add_argument("--prefill-workers", type=int, default=None, help="default 1")
    p.add_argument("--decode-workers", type=int, default=None, help="default 1")
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: bundled)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization", default=None, choices=["fp8"], help="workers serve FP8 weights (CUDA)"
    )
    p.add_argument(
        "--routing-policy", default=None, choices=["round_robin", "least_load", "prefix_aware"]
    )
    p.add_argument("--no-kvstore", action="store_true", help="run without the shared KV store")
    p.add_argument(
        "--no-gateway", action="store_true", help="run without the OpenAI-compatible HTTP gateway"
    )
    p.add_argument("--http-port", type=int, default=8000, help="the gateway's port; 0: any")
    p.add_argument("--log-dir", default=None, help="children's logs (default: a temp dir)")
    p.add_argument("--quiet", action="store_true", help="do not copy children's logs to stderr")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmfleet", description=__doc__.split("\n")[0])
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
        "gateway's URL on the next line) once every one is SERVING, stop them on SIGINT/SIGTERM.",
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
    return parser


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Sampling arguments as `SamplingParams` / `GenerationClient` keywords (unset: left out)."""
    kwargs: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "stop": tuple(args.stop),
        "n": getattr(args, "n", None),
        "logprobs": getattr(args, "logprobs", None),
    }
    return {k: v for k, v in kwargs.items() if v is not None}


# ---- output -------------------------------------------------------------------------------


class CompletionPrinter:
    """Writes completions to `out` in index order as their text arrives (see the epilog).

    Text of the completion being printed goes out at once; text of later ones is held until
    every earlier one has finished, so streamed output equals the non-streamed output.
    """

    def __init__(self, n: int, out: IO[str], err: IO[str]) -> None:
        self._n = max(n, 1)
        self._out = out
        self._err = err
        self._held: list[list[str]] = [[] for _ in range(self._n)]
        self._done = [False] * self._n
        self._positions = [0] * self._n
        self._current = 0
        self._opened = False

    def add(self, index: int, text: str, *, finished: bool, logprobs: Iterable[Any] = ()) -> None:
        for lp in logprobs:
            if lp is not None:
                self._write_logprobs(index, lp)
        if not 0 <= index < self._n:
            return
        if index == self._current:
            self._open()
            self._out.write(text)
        else:
            self._held[index].append(text)
        self._done[index] = self._done[index] or finished
        while self._current < self._n and self._done[self._current]:
            self._open()
            self._out.write("\n")
            self._current += 1
            self._opened = False
        if self._current < self._n and self._held[self._current]:
            self._open()  # writes the next completion's held text
        self._out.flush()

    def close(self) -> None:
        """End the output (the stream ended, maybe early): flush held text, end the line."""
        for i in range(self._current, self._n):
            self.add(i, "", finished=True)

    def _open(self) -> None:
        if not self._opened:
            self._opened = True
            if self._n > 1:
                self._out.write(f"--- completion {self._current} ---\n")
            if self._held[self._current]:
                self._out.write("".join(self._held[self._current]))
                self._held[self._current].clear()

    def _write_logprobs(self, index: int, lp: Any) -> None:
        record = {
            "completion": index,
            "position": self._positions[index] if 0 <= index < self._n else None,
            "token_id": lp.token_id,
            "logprob": lp.logprob,
            "rank": lp.rank,
            "top": [
                {"token_id": t, "logprob": v}
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ],
        }
        if 0 <= index < self._n:
            self._positions[index] += 1
        self._err.write(json.dumps(record) + "\n")
        self._err.flush()


# ---- remote (gRPC) ------------------------------------------------------------------------


# Flags that choose an engine's model: `--offline` and `llmfleet up` only, never a client's.
_ENGINE_FLAGS = ("model", "device", "dtype", "quantization")


def _client(args: argparse.Namespace):  # -> GenerationClient
    from llmfleet.client.generation import GenerationClient

    for flag in _ENGINE_FLAGS:
        if getattr(args, flag) is not None:
            raise ValidationError(
                f"--{flag}",
                "applies with --offline only; a fleet's model is chosen by `llmfleet up`",
            )
    return GenerationClient(args.endpoint)


def remote_generate(args: argparse.Namespace) -> int:
    kwargs = _sampling_kwargs(args)
    printer = CompletionPrinter(args.n, sys.stdout, sys.stderr)
    with _client(args) as client:
        if args.stream:
            for d in client.stream(args.prompt, raw=args.raw, timeout=args.timeout, **kwargs):
                finished = d.finish_reason is not None
                printer.add(d.index, d.text, finished=finished, logprobs=d.logprobs)
        else:
            res = client.generate(args.prompt, raw=args.raw, timeout=args.timeout, **kwargs)
            for c in res.completions:
                printer.add(c.index, c.text, finished=True, logprobs=c.logprobs)
            if res.usage is not None:
                logger.debug("usage: %s", res.usage)
    printer.close()
    return 0


def remote_chat(args: argparse.Namespace) -> int:
    kwargs = _sampling_kwargs(args)
    with _client(args) as client:
        return _chat_loop(
            args,
            lambda history: (
                d.text for d in client.stream(messages=history, timeout=args.timeout, **kwargs)
            ),
        )


def _chat_loop(args: argparse.Namespace, reply_to: Any) -> int:
    """Read user lines from stdin, stream each reply; `reply_to(history)` yields text pieces."""
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        if interactive:
            sys.stderr.write("\n> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        history.append({"role": "user", "content": line.strip()})
        reply = []
        for text in reply_to(history):
            sys.stdout.write(text)
            sys.stdout.flush()
            reply.append(text)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})


# ---- offline (engine in this process) -----------------------------------------------------


def _params(args: argparse.Namespace):  # -> SamplingParams
    from llmfleet.shared.core.sampling_params import SamplingParams

    return SamplingParams(**_sampling_kwargs(args))


def _llm(args: argparse.Namespace):  # -> LLM
    from llmfleet.client.llm import LLM
    from llmfleet.shared.core.config import EngineConfig, from_env

    config = from_env(
        EngineConfig,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
    )
    return LLM(config)


def offline_generate(args: argparse.Namespace) -> int:
    params = _params(args)  # validate before loading the model
    if args.stream and params.logprobs is not None:
        raise ValidationError("--logprobs", "with --stream needs a fleet (drop --offline)")
    llm = _llm(args)
    printer = CompletionPrinter(params.n, sys.stdout, sys.stderr)
    if args.stream:
        for delta in llm.stream(args.prompt, params, chat=not args.raw):
            printer.add(delta.index, delta.text, finished=delta.finish_reason is not None)
    else:
        [res] = llm.generate([args.prompt], params, chat=not args.raw)
        for c in res.completions:
            printer.add(c.index, c.text, finished=True, logprobs=c.logprobs)
    printer.close()
    return 0


def offline_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
    return _chat_loop(args, lambda history: (d.text for d in llm.stream(history, params)))


# ---- up -----------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from llmfleet.cli.launcher import FleetSpec, run

    if args.disaggregated and args.workers is not None:
        raise ValidationError("--workers", "use --prefill-workers/--decode-workers with it")
    if not args.disaggregated and (args.prefill_workers or args.decode_workers):
        raise ValidationError("--prefill-workers", "applies with --disaggregated only")
    spec = FleetSpec(
        host=args.host,
        port=args.port,
        disaggregated=args.disaggregated,
        workers=args.workers if args.workers is not None else 1,
        prefill_workers=args.prefill_workers if args.prefill_workers is not None else 1,
        decode_workers=args.decode_workers if args.decode_workers is not None else 1,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        routing_policy=args.routing_policy,
        kvstore=not args.no_kvstore,
        gateway=not args.no_gateway,
        http_port=args.http_port,
        log_dir=args.log_dir,
        echo=not args.quiet,
        startup_timeout_s=args.startup_timeout,
    )
    session = None
    if args.chat:

        def session(endpoint: str) -> int:
            # The engine flags chose the fleet's model; the chat itself is a plain client.
            chat_args = argparse.Namespace(**{**vars(args), "endpoint": endpoint})
            for flag in _ENGINE_FLAGS:
                setattr(chat_args, flag, None)
            return remote_chat(chat_args)

    return run(spec, session=session)


# ---- main ---------------------------------------------------------------------------------


def _report(exc: Exception, args: argparse.Namespace) -> int:
    """Print `exc` for a user; returns the exit status."""
    from llmfleet.client.generation import ClientError

    if isinstance(exc, ClientError):
        if exc.is_invalid_argument:
            print(f"error: {exc.message}", file=sys.stderr)
            return 2
        endpoint = getattr(args, "endpoint", None) or "the fleet"
        if exc.code_name == "UNAVAILABLE" and "failed to connect" in exc.message:
            print(
                f"error: cannot reach llmfleet at {endpoint} ({exc.message}); "
                "is a fleet running there? Start one with `llmfleet up`.",
                file=sys.stderr,
            )
        else:
            print(f"error: {exc.code_name}: {exc.message}", file=sys.stderr)
        return 1
    if isinstance(exc, ValidationError):
        print(f"error: invalid {exc.field}: {exc.message}", file=sys.stderr)
        return 2
    print(f"error: {exc}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command != "up" and args.endpoint is None:
        from llmfleet.client.generation import ClientConfig
        from llmfleet.shared.core.config import from_env

        args.endpoint = from_env(ClientConfig).endpoint
    try:
        if args.command == "up":
            return cmd_up(args)
        if args.command == "bench":
            from llmfleet.cli.benchserve.runner import main as bench_serve

            return bench_serve(args)
        if args.offline:
            return offline_generate(args) if args.command == "generate" else offline_chat(args)
        return remote_generate(args) if args.command == "generate" else remote_chat(args)
    except LLMFleetError as exc:
        return _report(exc, args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
