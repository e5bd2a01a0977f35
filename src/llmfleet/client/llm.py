"""The in-process Python API: prompts in, completions out (used by the CLI, tests, benches).

    llm = LLM()                                   # the bundled SmolLM2 on CPU
    [res] = llm.generate(["Hi!"], SamplingParams(max_tokens=32), chat=True)
    print(res.completions[0].text)

It owns detokenization and stop strings for in-process use (in the fleet the tokenizer
service does the same job with the same `IncrementalDetokenizer`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.engine.request import RequestOutput
from llmfleet.models.loader import LoadedModel
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.outputs import Completion
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.text.chat import tokenize_chat, tokenize_prompt
from llmfleet.text.detokenizer import IncrementalDetokenizer

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    num_cached_tokens: int = 0

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


@dataclass
class StreamDelta:
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


class LLM:
    def __init__(
        self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None
    ) -> None:
        config = config or EngineConfig()
        loaded = loaded or load_for(config)
        self.engine = LLMEngine(config, loaded)
        self.tokenizer = loaded.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: Prompt, *, chat: bool) -> list[int]:
        """Token ids of a prompt: text (raw or as one user chat message), chat messages, or ids."""
        if isinstance(prompt, str):
            if chat:
                return tokenize_chat(self.tokenizer, [{"role": "user", "content": prompt}])
            return tokenize_prompt(self.tokenizer, prompt)
        items = list(prompt)
        if items and isinstance(items[0], Mapping):
            return tokenize_chat(self.tokenizer, items)  # type: ignore[arg-type]
        return [int(t) for t in items]  # type: ignore[arg-type]

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        cache_salt: str = "",
    ) -> list[GenerationResult]:
        """Run all prompts to completion, batched continuously; results in prompt order."""
        results: dict[str, GenerationResult] = {}
        for _ in self._run(prompts, params, chat=chat, cache_salt=cache_salt, results=results):
            pass
        return list(results.values())

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False
    ) -> Iterator[StreamDelta]:
        """Yield text deltas of one prompt as they are generated."""
        yield from self._run([prompt], params, chat=chat, cache_salt="", results={})

    def _run(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        *,
        chat: bool,
        cache_salt: str,
        results: dict[str, GenerationResult],
    ) -> Iterator[StreamDelta]:
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError("need one SamplingParams per prompt")
        detoks: dict[tuple[str, int], IncrementalDetokenizer] = {}
        submitted: list[str] = []
        try:
            for prompt, p in zip(prompts, plist, strict=True):
                ids = self.encode(prompt, chat=chat)
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, ids, p, cache_salt=cache_salt)
                submitted.append(rid)
                results[rid] = GenerationResult(rid, ids, [Completion(i) for i in range(p.n)])
                for i in range(p.n):
                    detoks[(rid, i)] = IncrementalDetokenizer(
                        self.tokenizer,
                        ids,
                        skip_special_tokens=p.skip_special_tokens,
                        stop=p.stop,
                        include_stop_str_in_output=p.include_stop_str_in_output,
                    )
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    delta = self._apply(out, results[out.request_id], detoks)
                    if delta is not None:
                        yield delta
        finally:
            for rid in submitted:  # a consumer that stops early must not leak KV blocks
                self.engine.abort(rid)

    def _apply(
        self,
        out: RequestOutput,
        res: GenerationResult,
        detoks: dict[tuple[str, int], IncrementalDetokenizer],
    ) -> StreamDelta | None:
        comp = res.completions[out.index]
        if comp.finish_reason is not None:
            return None  # ended by a stop string already
        res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
        detok = detoks[(out.request_id, out.index)]
        # A speculative step brings several tokens: the completion ends with the one that
        # completes a stop string, as it would one token per step.
        text, num_kept = detok.add_tokens_until_stop(out.new_token_ids)
        comp.token_ids.extend(out.new_token_ids[:num_kept])
        comp.logprobs.extend(lp for lp in out.new_logprobs[:num_kept] if lp is not None)
        finish_reason = out.finish_reason
        if detok.stop_reason is not None:
            finish_reason, comp.stop_string = "stop", detok.stop_reason
            multi = len(res.completions) > 1
            seq_id = f"{out.request_id}#{out.index}" if multi else out.request_id
            self.engine.stop_request(seq_id, detok.stop_reason)
        elif finish_reason is not None:
            text += detok.finish()
            if isinstance(out.stop_reason, int):
                comp.stop_token_id = out.stop_reason
        comp.text += text
        comp.finish_reason = finish_reason
        kept = out.new_token_ids[:num_kept]
        return StreamDelta(out.request_id, out.index, text, kept, finish_reason)
