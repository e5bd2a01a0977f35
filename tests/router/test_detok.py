"""The router's Detokenizer: every completion on one Detokenize stream, the feeds of one turn of
the event loop in one request, and a broken stream failing only the sequences it carried."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from fakes import FakeTokenizer
from harness import run

from llmfleet.services.router import detok as detok_module
from llmfleet.services.router.detok import Detokenizer, DetokSequence
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.service import Unavailable
from llmfleet.v1 import tokenizer_pb2_grpc


async def _with_tokenizer(body):
    fakes = [FakeTokenizer()]
    await fakes[0].start()
    channel = grpc.aio.insecure_channel(fakes[0].address)
    detok = Detokenizer(tokenizer_pb2_grpc.TokenizerStub(channel))
    try:
        return await body(fakes, detok, channel)
    finally:
        await detok.close_stream()
        await channel.close()
        await fakes[-1].stop()


def test_one_turn_of_feeds_is_one_request_and_each_gets_its_text():
    async def body(fakes, detok, channel):
        fake = fakes[0]
        seqs = [DetokSequence(detok, index=i) for i in range(50)]
        for s in seqs:
            s.open([], SamplingParams())
        words = [f"w{i} ".encode() for i in range(50)]
        got = await asyncio.gather(
            *(s.feed(list(w), False) for s, w in zip(seqs, words, strict=True))
        )
        assert [text for text, _, _ in got] == [w.decode() for w in words]
        assert [used for _, _, used in got] == [len(w) for w in words]
        reqs = fake.detokenize_requests
        assert [len(r.feeds) for r in reqs if r.feeds] == [50]  # one request for all feeds
        assert sum(len(r.opens) for r in reqs) == 50 and len(reqs) <= 2
        for s in seqs[:10]:
            s.close()
        await asyncio.sleep(0.05)
        assert list(fake.detokenize_requests[-1].closes) == list(range(1, 11))

    run(_with_tokenizer(body))


def test_stop_strings_and_finished_sequences():
    async def body(fakes, detok, channel):
        fake = fakes[0]
        a, b = DetokSequence(detok), DetokSequence(detok)
        a.open([], SamplingParams(stop=["END"]))
        b.open([], SamplingParams())
        (ta, sa, ua), (tb, sb, ub) = await asyncio.gather(
            a.feed(list(b"go END more"), False), b.feed(list(b"done"), True)
        )
        assert (ta, sa, a.stopped) == ("go ", "END", True)
        assert ua == len(b"go END")  # the tokens after the stop string are not the text's
        assert (tb, sb, ub) == ("done", "", 4)
        a.close()
        b.close()  # finished: the tokenizer closed it already, nothing to send
        await asyncio.sleep(0.05)
        assert [list(r.closes) for r in fake.detokenize_requests if r.closes] == [[1]]

    run(_with_tokenizer(body))


def test_a_broken_stream_fails_its_sequences_and_the_next_open_starts_anew():
    async def body(fakes, detok, channel):
        old = DetokSequence(detok)
        old.open([], SamplingParams())
        assert await old.feed(list(b"hi"), False) == ("hi", "", 2)
        port = int(fakes[0].address.rpartition(":")[2])
        await fakes[0].stop()  # the tokenizer goes away: the stream breaks
        with pytest.raises(Unavailable, match="^tokenizer: "):
            await old.feed(list(b"more"), False)
        # A sequence opened while the tokenizer is still away (as while a supervisor restarts
        # it): its stream waits for the tokenizer to be back instead of failing at once.
        new = DetokSequence(detok)
        new.open([], SamplingParams())
        fresh = asyncio.ensure_future(new.feed(list(b"fresh"), True))
        await asyncio.sleep(0.3)
        assert not fresh.done()
        fakes.append(FakeTokenizer())  # and comes back on the same port
        await fakes[-1].start(port)
        assert await asyncio.wait_for(fresh, 30) == ("fresh", "", 5)
        with pytest.raises(Unavailable):  # the old sequence stays lost
            await old.feed(list(b"again"), False)
        old.close()
        assert detok.num_sequences_lost == 0

    run(_with_tokenizer(body))


def test_a_stream_waits_a_bounded_time_for_an_unreachable_tokenizer(monkeypatch):
    monkeypatch.setattr(detok_module, "CONNECT_TIMEOUT_S", 0.5)

    async def body(fakes, detok, channel):
        await fakes[0].stop()  # gone before the stream opens, and not coming back
        seq = DetokSequence(detok)
        seq.open([], SamplingParams())
        start = time.monotonic()
        with pytest.raises(Unavailable, match="not reachable within 0.5 s"):
            await seq.feed(list(b"hi"), False)
        assert 0.4 < time.monotonic() - start < 10

    run(_with_tokenizer(body))
