"""`llmfleet generate` and `llmfleet chat`: against a fleet over gRPC (`remote_*`), or with the
engine in this process (`offline_*`, `--offline`). Only completions go to stdout; the chat's
prompts and every message go to stderr. Errors are raised (`LLMFleetError`) for `main` to
report.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from llmfleet.cli.printer import CompletionPrinter
from llmfleet.shared.core.errors import ValidationError

logger = logging.getLogger("llmfleet")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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


# Flags that choose an engine's model: `--offline` and `llmfleet up` only, never a client's.
ENGINE_FLAGS = ("model", "device", "dtype", "quantization")


def _client(args: argparse.Namespace):  # -> GenerationClient
    from llmfleet.client.generation import GenerationClient

    for flag in (*ENGINE_FLAGS, "tensor_parallel_size"):
        if getattr(args, flag, None) is not None:
            raise ValidationError(
                f"--{flag.replace('_', '-')}",
                "applies with --offline only; a fleet's model is chosen by `llmfleet up`",
            )
    return GenerationClient(args.endpoint, api_key=args.api_key)


def remote_generate(args: argparse.Namespace) -> int:
    kwargs = sampling_kwargs(args)
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
    kwargs = sampling_kwargs(args)
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


def _params(args: argparse.Namespace):  # -> SamplingParams
    from llmfleet.shared.core.sampling_params import SamplingParams

    return SamplingParams(**sampling_kwargs(args))


def _llm(args: argparse.Namespace):  # -> LLM
    from llmfleet.client.llm import LLM
    from llmfleet.shared.core.config import EngineConfig, from_env

    config = from_env(
        EngineConfig,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
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
