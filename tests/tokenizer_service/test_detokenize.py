"""The tokenizer service's Detokenize stream: many sequences on one stream, each equal to the
core `IncrementalDetokenizer`, errors confined to their sequence, one answer per request that
feeds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import prometheus_client
import pytest

from llmfleet.text.chat import tokenize_chat
from llmfleet.text.detokenizer import IncrementalDetokenizer
from llmfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc

from .service_helpers import TEXT, serving

pytestmark = pytest.mark.timeout(120)


def _open(
    sid: int = 1, prompt: Sequence[int] = (), stop: Sequence[str] = (), include: bool = False
) -> tokenizer_pb2.DetokenizeOpen:
    return tokenizer_pb2.DetokenizeOpen(
        sequence_id=sid, prompt_token_ids=list(prompt), stop=list(stop),
        include_stop_str_in_output=include,
    )  # fmt: skip


def _feed(sid: int, ids: Sequence[int], finished: bool = False) -> tokenizer_pb2.DetokenizeFeed:
    return tokenizer_pb2.DetokenizeFeed(sequence_id=sid, token_ids=list(ids), finished=finished)


async def _stream(
    stub: tokenizer_pb2_grpc.TokenizerStub, requests: list[tokenizer_pb2.DetokenizeRequest]
) -> list[list[tokenizer_pb2.DetokenizedText]]:
    async def gen() -> AsyncIterator[tokenizer_pb2.DetokenizeRequest]:
        for r in requests:
            yield r

    return [list(r.texts) async for r in stub.Detokenize(gen())]


async def _detokenize(
    stub: tokenizer_pb2_grpc.TokenizerStub,
    op: tokenizer_pb2.DetokenizeOpen,
    chunks: list[list[int]],
    *,
    finish: bool,
) -> list[tuple[str, str]]:
    """One sequence alone on a stream: (text, stop string) per chunk."""
    requests = [tokenizer_pb2.DetokenizeRequest(opens=[op])]
    for i, chunk in enumerate(chunks):
        feed = _feed(op.sequence_id, chunk, finished=finish and i == len(chunks) - 1)
        requests.append(tokenizer_pb2.DetokenizeRequest(feeds=[feed]))
    return [(t.text, t.stop_string) for [t] in await _stream(stub, requests)]


def _reference(
    tokenizer: Any,
    prompt: list[int],
    chunks: list[list[int]],
    stop: Sequence[str],
    include: bool,
    *,
    finish: bool,
) -> list[tuple[str, str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop, include_stop_str_in_output=include)
    out = []
    for i, chunk in enumerate(chunks):
        text = detok.add_tokens(chunk)
        if finish and i == len(chunks) - 1:
            text += detok.finish()
        out.append((text, detok.stop_reason or ""))
    return out


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize(
    ("stop", "include"), [((), False), (("STOP",), False), (("STOP", "lazy"), True)]
)
def test_detokenize_stream_equals_incremental_detokenizer(tokenizer, chunk, stop, include):
    prompt = tokenize_chat(tokenizer, [{"role": "user", "content": "Say something."}])
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]

    async def body() -> list[tuple[str, str]]:
        async with serving(tokenizer) as (stub, _):
            return await _detokenize(stub, _open(1, prompt, stop, include), chunks, finish=True)

    got = asyncio.run(body())
    want = _reference(tokenizer, prompt, chunks, stop, include, finish=True)
    assert got == want
    assert len(got) == len(chunks)  # one answer per feed
    text = "".join(t for t, _ in got)
    if not stop:
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert all(s == "" for _, s in got)
    else:
        first = stop[0] if TEXT.find(stop[0]) < TEXT.find(stop[-1]) else stop[-1]
        assert text.endswith(first) == include
        assert got[-1][1] == first  # sticky once matched


def test_a_feed_of_several_tokens_ends_at_the_one_completing_a_stop_string(tokenizer):
    """A feed may carry several tokens (a speculative step's, or steps joined): the answer says
    how many of them the text used, up to and including the token that completed the stop
    string, so the router drops the rest; feeds without a match leave it 0."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    ends = -1  # then the index of the token completing "STOP"
    while not detok.stop_reason:
        ends += 1
        detok.add_tokens([ids[ends]])
    assert ends + 3 < len(ids)  # tokens follow the one that completes "STOP"
    start = max(0, ends - 2)
    feeds = [ids[:start], ids[start:]]  # the second feed: two before, the end, and more after

    async def body() -> list[tokenizer_pb2.DetokenizedText]:
        async with serving(tokenizer) as (stub, _):
            requests = [tokenizer_pb2.DetokenizeRequest(opens=[_open(1, stop=["STOP"])])]
            requests += [tokenizer_pb2.DetokenizeRequest(feeds=[_feed(1, f)]) for f in feeds]
            return [t for [t] in await _stream(stub, requests)]

    first, second = asyncio.run(body())
    assert (first.stop_string, first.num_tokens) == ("", 0)
    assert second.stop_string == "STOP"
    assert second.num_tokens == ends - start + 1
    assert first.text + second.text == TEXT[: TEXT.find("STOP")]


def test_many_sequences_share_one_stream(tokenizer):
    """Interleaved sequences, fed in batches, each get the text they would get alone; only
    requests that feed are answered, one text per feed in feed order."""
    texts = ["The quick brown fox.", "Hello world, again and again.", "Numbers: 1, 22, 333."]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    stops = [(), ("again",), ()]
    steps = max(len(x) for x in ids)
    requests = [
        tokenizer_pb2.DetokenizeRequest(opens=[_open(10 + i, stop=stops[i]) for i in range(3)])
    ]
    for s in range(steps):
        feeds = [
            _feed(10 + i, [x[s]], finished=s == len(x) - 1) for i, x in enumerate(ids) if s < len(x)
        ]
        requests.append(tokenizer_pb2.DetokenizeRequest(feeds=feeds[::-1]))  # any order
    requests.append(tokenizer_pb2.DetokenizeRequest(closes=[10, 11, 12]))  # not answered

    async def body():
        async with serving(tokenizer) as (stub, _):
            return await _stream(stub, requests)

    answers = asyncio.run(body())
    assert len(answers) == steps
    for i, x in enumerate(ids):
        got = [t for step in answers for t in step if t.sequence_id == 10 + i]
        want = _reference(tokenizer, [], [[t] for t in x], stops[i], False, finish=True)
        assert [(t.text, t.stop_string) for t in got] == want
        assert not any(t.error for t in got)
    for step, request in zip(answers, requests[1:], strict=False):
        assert [t.sequence_id for t in step] == [f.sequence_id for f in request.feeds]


def test_finished_flushes_held_back_text(tokenizer):
    ids = tokenizer.encode("Hello ST", add_special_tokens=False)

    async def body() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        async with serving(tokenizer) as (stub, _):
            held = await _detokenize(stub, _open(stop=["STOP"]), [ids], finish=False)
            flushed = await _detokenize(stub, _open(stop=["STOP"]), [ids], finish=True)
            return held, flushed

    held, flushed = asyncio.run(body())
    assert held == [("Hello ", "")]  # "ST" might still become "STOP"
    assert flushed == [("Hello ST", "")]


def test_ids_past_the_tokenizer_vocabulary_decode_to_nothing(tokenizer):
    """A model's padded vocabulary rows (ids >= len(tokenizer)) can be sampled; they have no
    text, and the text around them is unchanged."""
    hello = tokenizer.encode("Hello world", add_special_tokens=False)
    padded = [hello[0], len(tokenizer), len(tokenizer) + 7, *hello[1:]]

    async def body() -> list[tuple[str, str]]:
        async with serving(tokenizer) as (stub, _):
            return await _detokenize(stub, _open(), [padded], finish=True)

    assert "".join(text for text, _ in asyncio.run(body())) == "Hello world"


@pytest.mark.parametrize(
    ("opens", "feeds", "field"),
    [
        ([], [_feed(1, [5])], "feeds.sequence_id"),  # never opened
        ([_open(1), _open(1)], [_feed(1, [5])], "opens.sequence_id"),  # opened twice
        ([_open(1)], [_feed(1, [5, -3])], "feeds.token_ids[1]"),
        ([_open(1, prompt=[-1])], [_feed(1, [5])], "opens.prompt_token_ids[0]"),
        ([_open(1, stop=["ok", ""])], [_feed(1, [5])], "opens.stop[1]"),
        ([_open(1)], [_feed(1, [5], finished=True), _feed(1, [6])], "feeds.sequence_id"),
    ],
)
def test_a_bad_sequence_fails_alone_naming_the_field(tokenizer, opens, feeds, field):
    """The bad sequence's answer carries the error; a good sequence on the same stream, fed in
    the same requests, is answered as usual."""
    good = _open(99)
    requests = [
        tokenizer_pb2.DetokenizeRequest(opens=[*opens, good]),
        *[tokenizer_pb2.DetokenizeRequest(feeds=[f, _feed(99, [42])]) for f in feeds],
    ]

    async def body():
        async with serving(tokenizer) as (stub, _):
            return await _stream(stub, requests)

    answers = asyncio.run(body())
    bad = answers[-1][0]
    assert bad.error.startswith(f"{field}: ") and bad.text == ""
    assert all(not step[1].error for step in answers)


def test_latency_histogram_counts_each_request(tokenizer):
    name = "llmfleet:tokenizer_latency_seconds_count"

    def count(op: str) -> float:
        return prometheus_client.REGISTRY.get_sample_value(name, {"op": op}) or 0.0

    before = count("tokenize"), count("detokenize")

    async def body() -> None:
        async with serving(tokenizer) as (stub, _):
            await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"))
            await _detokenize(stub, _open(), [[1, 2], [3]], finish=True)

    asyncio.run(body())
    assert count("tokenize") == before[0] + 1
    assert count("detokenize") == before[1] + 3  # the open, then two feeds
