"""Limits that hold and status codes that do not mislead, on a real fleet (tokenizer, router, one
simulated worker with a 2048-token context, the HTTP gateway) started with small limits: a 1 MiB
HTTP body limit, an 8 MiB gRPC message limit and room for 2 requests in the router.

An oversize body is a 413 before it is read; an oversize gRPC message RESOURCE_EXHAUSTED naming
the limit; a prompt over the context an error of the prompt naming its length and the limit
(found by a cheap bound before tokenizing a huge one); overload carries Retry-After /
grpc-retry-pushback-ms; malformed protobuf is INVALID_ARGUMENT on every service; a lease TTL
past the maximum is refused."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import openai
import pytest

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import ClientError, GenerationClient
from llmfleet.shared.core.config import RouterConfig, WorkerConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

BODY_LIMIT = 1 << 20
MESSAGE_LIMIT = 8 << 20
CONTEXT = 2048
# ~140K tokens of English in 520 KB (the bundled tokenizer): the cheap bound (at most 81 bytes a
# token) shows it over the context.
HUGE_PROMPT = "hello world, how are you? " * 20_000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    spec = FleetSpec(
        port=0,
        workers=1,
        engine={"simulate": True, "sim_step_ms": 20.0, "max_model_len": CONTEXT},
        kvstore=False,
        gateway=True,
        http_port=0,
        extra_args={
            "gateway": ["--max-request-bytes", str(BODY_LIMIT)],
            "router": ["--max-message-bytes", str(MESSAGE_LIMIT), "--max-queued-requests", "2"],
        },
        log_dir=str(tmp_path_factory.mktemp("logs")),
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    with GenerationClient(fleet.endpoint) as c:
        yield c


def oai(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.http_url}/v1", api_key="x", max_retries=0, timeout=60)


def raw_http(fleet: Fleet, head: str, chunks: Sequence[bytes] = ()) -> tuple[int, dict, dict]:
    """Send a request's head and body bytes on a fresh connection; (status, headers, JSON body)
    of the answer, read until the server closes."""
    host, port = fleet.http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode())
        for c in chunks:
            s.sendall(c)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            part = s.recv(65536)
            if not part:
                break
            data += part
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 62


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def served_model(fleet: Fleet) -> str:
    return oai(fleet).models.list().data[0].id


# ---- HTTP body limit --------------------------------------------------------------------------


def test_a_declared_100MB_body_is_413_before_any_of_it_is_sent(fleet):
    start = time.monotonic()
    status, headers, body = raw_http(
        fleet,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {100 << 20}\r\n\r\n",
    )
    assert status == 413 and time.monotonic() - start < 5
    assert body["error"]["code"] == "request_too_large"
    assert body["error"]["type"] == "invalid_request_error"
    assert str(BODY_LIMIT) in body["error"]["message"]


def test_a_chunked_body_is_413_once_it_passes_the_limit_with_bounded_memory(fleet):
    pid = fleet.child("gateway").proc.pid
    before = rss_bytes(pid)
    piece = b"x" * (64 << 10)
    for _ in range(5):
        # One piece over the limit and no end of the body: the answer cannot wait for the rest.
        status, _, body = raw_http(
            fleet,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n",
            [chunk(piece)] * (BODY_LIMIT // len(piece) + 1),
        )
        assert status == 413, body
        assert body["error"]["code"] == "request_too_large"
    assert rss_bytes(pid) - before < 32 << 20


def test_a_chunked_body_within_the_limit_is_served(fleet):
    payload = json.dumps(
        {"model": served_model(fleet), "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    ).encode()
    status, _, body = raw_http(
        fleet,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        [chunk(payload[:10]), chunk(payload[10:]), b"0\r\n\r\n"],
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 2


# ---- gRPC message size ------------------------------------------------------------------------


def test_an_oversize_grpc_message_is_resource_exhausted_naming_the_limit(client):
    with pytest.raises(ClientError) as err:
        client.generate("a" * (MESSAGE_LIMIT + 1024), raw=True, max_tokens=1)
    assert err.value.code_name == "RESOURCE_EXHAUSTED"
    assert str(MESSAGE_LIMIT) in err.value.message
    assert err.value.retry_after_s is None  # no retry helps


def test_a_prompt_the_public_port_takes_never_fails_an_internal_hop(client):
    # 7 MB of text: taken by the public port, refused for its length, not by a channel limit.
    with pytest.raises(ClientError) as err:
        client.generate("a " * (3_500_000), raw=True, max_tokens=1)
    assert err.value.code_name == "INVALID_ARGUMENT", err.value
    assert err.value.message.startswith("text: the prompt has at least")


# ---- prompt length ----------------------------------------------------------------------------


def test_a_100K_token_prompt_is_invalid_naming_its_length_without_tokenizing_it(client):
    start = time.monotonic()
    with pytest.raises(ClientError) as err:
        client.generate(HUGE_PROMPT, raw=True, max_tokens=16)
    elapsed = time.monotonic() - start
    assert err.value.code_name == "INVALID_ARGUMENT"
    # "at least": the bound, not a count (a count would need the whole text tokenized)
    assert err.value.message == (
        f"text: the prompt has at least 6420 tokens, more than the context length of "
        f"{CONTEXT} tokens"
    )
    assert elapsed < 2.0
    with pytest.raises(ClientError) as err:  # as chat messages
        client.generate(messages=[{"role": "user", "content": HUGE_PROMPT}], max_tokens=16)
    assert err.value.code_name == "INVALID_ARGUMENT"
    assert err.value.message.startswith("chat.messages: the prompt has at least")


def test_a_prompt_just_over_the_context_is_counted_exactly(client):
    with pytest.raises(ClientError) as err:
        client.generate("hello " * (CONTEXT + 100), raw=True, max_tokens=1)
    assert err.value.code_name == "INVALID_ARGUMENT"
    assert err.value.message.startswith("text: the prompt has 2")
    assert err.value.message.endswith(f"more than the context length of {CONTEXT} tokens")
    with pytest.raises(ClientError) as err:
        client.generate(token_ids=[1] * (CONTEXT + 1), max_tokens=1)
    assert err.value.message == (
        f"tokens.token_ids: the prompt has {CONTEXT + 1} tokens, more than the context "
        f"length of {CONTEXT} tokens"
    )
    # A prompt that fits but leaves too little room is still max_tokens' fault.
    with pytest.raises(ClientError) as err:
        client.generate(token_ids=[1] * (CONTEXT - 4), max_tokens=16)
    assert err.value.message.startswith("sampling.max_tokens:")


def test_http_prompts_over_the_context_are_400_naming_the_prompt(fleet):
    model, api = served_model(fleet), oai(fleet)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model, prompt=HUGE_PROMPT, max_tokens=4)
    assert err.value.status_code == 400 and err.value.param == "prompt"
    assert f"more than the context length of {CONTEXT} tokens" in err.value.message
    for max_tokens in (None, 4):  # counted in the gateway (default max_tokens) / the router
        kwargs = {} if max_tokens is None else {"max_tokens": max_tokens}
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": HUGE_PROMPT}], **kwargs
            )
        assert err.value.status_code == 400 and err.value.param == "messages"
        assert "the prompt has at least" in err.value.message


# ---- overload: retry pushback -----------------------------------------------------------------


def test_overload_carries_retry_pushback_and_retry_after(fleet, client):
    # Two long requests fill the router's room for 2.
    streams = [client.stream("Tell me a story", raw=True, max_tokens=1500) for _ in range(2)]
    deltas = [iter(s) for s in streams]  # kept: dropping one cancels its call
    try:
        for d in deltas:
            next(d)  # admitted and streaming
        with grpc.insecure_channel(fleet.endpoint) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            req = generation_pb2.GenerateRequest(text="Hi")
            req.sampling.max_tokens = 1
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, timeout=30))
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        pushback = dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"]
        assert int(pushback) > 0
        with pytest.raises(openai.RateLimitError) as http_err:
            oai(fleet).completions.create(model=served_model(fleet), prompt="Hi", max_tokens=1)
        assert http_err.value.status_code == 429
        assert int(http_err.value.response.headers["retry-after"]) >= 1
    finally:
        for s in streams:
            s.close()
    deadline = time.monotonic() + 30  # the room frees once the cancels land
    while True:
        try:
            client.generate("Hi", raw=True, max_tokens=1)
            break
        except ClientError as exc:
            if exc.code_name != "RESOURCE_EXHAUSTED" or time.monotonic() > deadline:
                raise


# ---- malformed messages -----------------------------------------------------------------------

MALFORMED = b"\x0a\x05ab"  # field 1, 5 bytes long, 2 bytes given


@pytest.mark.parametrize(
    "target, method, streaming",
    [
        ("router", "/llmfleet.v1.Generation/Generate", "unary_stream"),
        ("router", "/llmfleet.v1.Generation/GetModelInfo", "unary_unary"),
        ("registry", "/llmfleet.v1.Registry/Heartbeat", "unary_unary"),
        ("tokenizer", "/llmfleet.v1.Tokenizer/Tokenize", "unary_unary"),
        ("tokenizer", "/llmfleet.v1.Tokenizer/Detokenize", "stream_stream"),
        ("worker", "/llmfleet.v1.Worker/ReserveKV", "unary_unary"),
    ],
)
def test_malformed_bytes_are_invalid_argument_on_every_service(fleet, target, method, streaming):
    address = {
        "router": fleet.endpoint,
        "registry": fleet.registry_address,
        "tokenizer": fleet.tokenizer_address,
        "worker": fleet.worker_addresses[0],
    }[target]
    with grpc.insecure_channel(address) as ch:
        call = getattr(ch, streaming)(method)  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as err:
            if streaming == "unary_unary":
                call(MALFORMED, timeout=10)
            elif streaming == "unary_stream":
                list(call(MALFORMED, timeout=10))
            else:
                list(call(iter([MALFORMED]), timeout=10))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "malformed" in err.value.details()


# ---- internal values --------------------------------------------------------------------------


def test_a_huge_lease_ttl_is_refused(fleet):
    with grpc.insecure_channel(fleet.worker_addresses[0]) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.ReserveKV(
                worker_pb2.ReserveKVRequest(request_id="r", num_prompt_tokens=16, ttl_ms=2**62),
                timeout=10,
            )
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("ttl_ms: must be in (0, 600000] ms")
    for cls in (RouterConfig, WorkerConfig):  # nor can a service be configured with one
        with pytest.raises(ValidationError, match="lease_ttl_ms"):
            cls(lease_ttl_ms=2**62)


# ---- the cheap bound is sound -----------------------------------------------------------------


def test_the_token_bound_never_exceeds_the_true_count():
    from llmfleet.text.chat import tokenize_prompt
    from llmfleet.text.loading import load_tokenizer
    from llmfleet.text.prompt_bound import max_bytes_per_token, min_num_tokens

    tok = load_tokenizer(None)
    per_token = max_bytes_per_token(tok)
    assert per_token is not None
    rng = random.Random(0)
    longest = max(tok.get_vocab(), key=len)  # a whitespace run: the longest piece
    texts = [
        HUGE_PROMPT,
        " " * 10_000,
        "\n" + " " * 80,
        tok.convert_tokens_to_string([longest]) * 50,
        "".join(
            chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x4E00, 0x9FFF)]))
            for _ in range(5000)
        ),  # fmt: skip
        "<|im_start|>" * 100,
    ]
    for text in texts:
        assert min_num_tokens(text, per_token) <= len(tokenize_prompt(tok, text))


def test_tokenizers_whose_tokens_are_unbounded_get_no_bound():
    from llmfleet.text.prompt_bound import _shrink_factor, _unknown_span

    assert _shrink_factor({"type": "StripAccents"}) is None  # deletes characters
    assert _shrink_factor({"type": "Sequence", "normalizers": [{"type": "NFKC"}]}) == 4
    assert _unknown_span({"type": "BPE", "unk_token": "<unk>", "fuse_unk": True}) is None
    assert _unknown_span({"type": "WordLevel", "unk_token": "<unk>"}) is None


def test_grpc_size_and_overload_errors_map_to_413_and_429_with_retry_after():
    from llmfleet.services.gateway.errors import from_client_error

    too_large = from_client_error(
        ClientError("RESOURCE_EXHAUSTED", "Received message larger than max (9000000 vs. 8388608)")
    )
    assert too_large.status == 413 and too_large.code == "request_too_large"
    assert "Retry-After" not in too_large.headers
    full = from_client_error(ClientError("RESOURCE_EXHAUSTED", "queue full", retry_after_s=2.5))
    assert full.status == 429 and full.headers["Retry-After"] == "3"
    no_pushback = from_client_error(ClientError("RESOURCE_EXHAUSTED", "worker full"))
    assert no_pushback.status == 429 and no_pushback.headers["Retry-After"] == "1"


def test_a_public_message_limit_over_the_internal_one_is_refused():
    with pytest.raises(ValidationError, match="max_message_bytes"):
        RouterConfig(max_message_bytes=(64 << 20) + 1)
