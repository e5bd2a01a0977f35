"""The `llmfleet` command line.

    llmfleet generate --offline [--raw] [--max-tokens N] [--temperature T] [--seed S] PROMPT
    llmfleet chat --offline

`--offline` runs the engine in this process. Only the completion goes to stdout; progress and
logs go to stderr. Bad input exits with status 2 and the validation message.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from llmfleet.shared.errors import LLMFleetError, ValidationError

logger = logging.getLogger("llmfleet")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="HF checkpoint directory or .gguf file (default: bundled SmolLM2)"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--offline", action="store_true", help="run the engine in this process")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmfleet", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the completion")
    _engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("prompt")
    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    _engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    return parser


def _params(args: argparse.Namespace):  # -> SamplingParams
    from llmfleet.services.worker.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _llm(args: argparse.Namespace):  # -> LLM
    from llmfleet.services.worker.engine.llm import LLM
    from llmfleet.shared.config import EngineConfig, from_env

    config = from_env(EngineConfig, model=args.model, device=args.device, dtype=args.dtype)
    return LLM(config)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)  # validate before loading the model
    llm = _llm(args)
    if args.stream:
        for delta in llm.stream(args.prompt, params, chat=not args.raw):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        [res] = llm.generate([args.prompt], params, chat=not args.raw)
        print(res.completions[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
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
        for delta in llm.stream(history, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            reply.append(delta.text)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.offline:
        print(
            "error: no fleet endpoint is configured yet; pass --offline to run the engine "
            "in this process",
            file=sys.stderr,
        )
        return 2
    try:
        return cmd_generate(args) if args.command == "generate" else cmd_chat(args)
    except ValidationError as e:
        print(f"error: invalid {e.field}: {e.message}", file=sys.stderr)
        return 2
    except LLMFleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
