"""The gateway's pure mapping: OpenAI bodies to Generate calls, results to OpenAI objects,
gRPC errors to OpenAI errors, token spellings. No fleet, no I/O."""

from __future__ import annotations

import pytest
from tiny_models import bytes_to_unicode, make_tokenizer

from llmfleet.client.generation import ClientError
from llmfleet.client.messages import Delta, GenerateResult, Usage, build_request
from llmfleet.services.gateway import convert
from llmfleet.services.gateway.app import body_error, loc_to_param
from llmfleet.services.gateway.convert import Call
from llmfleet.services.gateway.errors import APIError, from_client_error, param_for
from llmfleet.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from llmfleet.services.gateway.streaming import ChunkBuilder
from llmfleet.services.gateway.tokens import TokenSpeller, _byte_level_alphabet
from llmfleet.shared.core.image_source import ImageSource
from llmfleet.shared.core.outputs import Completion, TokenLogprobs


@pytest.fixture(scope="module")
def speller() -> TokenSpeller:
    return TokenSpeller(make_tokenizer())  # byte-level: token id b < 256 is byte b


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def rejected(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


# ---- requests -----------------------------------------------------------------------------


def test_chat_request_maps_every_sampling_field():
    call = convert.chat_call(
        chat(
            n=2, stop="END", max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9,
            seed=3, presence_penalty=0.1, frequency_penalty=0.2, logprobs=True, top_logprobs=4,
            top_k=5, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, user="u",
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    k = call.kwargs
    assert k["messages"] == [{"role": "user", "content": "hi"}]
    assert (k["n"], k["stop"], k["max_tokens"], k["logprobs"]) == (2, ["END"], 7, 4)
    assert (k["temperature"], k["top_p"], k["seed"], k["top_k"], k["min_p"]) == (
        0.5, 0.9, 3, 5, 0.05,
    )  # fmt: skip
    assert (k["presence_penalty"], k["frequency_penalty"], k["repetition_penalty"]) == (
        0.1, 0.2, 1.1,
    )  # fmt: skip
    assert k["ignore_eos"] is True and call.include_usage and call.stream and call.logprobs
    assert call.request_id.startswith("chatcmpl-")
    # Server errors about these fields name the parameter the client used.
    assert call.params == {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
    pb = build_request(request_id=call.request_id, **k)  # the client accepts every keyword
    assert pb.sampling.n == 2 and list(pb.sampling.stop) == ["END"] and pb.sampling.logprobs == 4
    assert pb.request_id == call.request_id


def test_chat_defaults_leave_max_tokens_to_the_context_and_no_logprobs():
    call = convert.chat_call(chat())
    assert call.kwargs["max_tokens"] is None and "logprobs" not in call.kwargs
    assert not call.logprobs and not call.include_usage and call.kwargs["stop"] == []
    assert convert.chat_call(chat(logprobs=True)).kwargs["logprobs"] == 0
    assert convert.default_max_tokens(30, 100) == 70
    assert rejected(convert.default_max_tokens, 100, 100).param == "messages"


def test_chat_messages_parts_and_roles():
    req = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": t} for t in ("a", "b")]},
            {"role": "assistant", "content": None},
        ],
    )  # fmt: skip
    assert convert.chat_messages(req.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]
    bad = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": image}])
    assert rejected(convert.chat_call, bad).param == "messages[0].content[0].image_url"
    audio = [{"type": "input_audio", "input_audio": {}}]
    bad = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": audio}])
    assert rejected(convert.chat_call, bad).param == "messages[0].content[0]"
    parts = [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAEC"}},
        {"type": "image_url", "image_url": "file:///m/cat.png"},
    ]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": parts}])
    assert convert.chat_messages(req.messages) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image", "image": ImageSource(data=b"\x00\x01\x02")},
                {"type": "image", "image": ImageSource(url="file:///m/cat.png")},
            ],
        }
    ]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"1": 5.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_chat_features_are_400_naming_the_field(kwargs, param):
    assert rejected(convert.chat_call, chat(**kwargs)).param == param


def test_completion_prompt_shapes():
    def kwargs(prompt):
        return convert.completion_call(CompletionRequest(model="m", prompt=prompt)).kwargs

    assert kwargs("hello")["prompt"] == "hello" and kwargs("hello")["raw"] is True
    assert kwargs([1, 2, 3])["token_ids"] == [1, 2, 3]
    assert kwargs(["one"])["prompt"] == "one"
    assert kwargs([[4, 5]])["token_ids"] == [4, 5]
    assert "max_tokens" not in kwargs("x")  # the server's default, 16 as OpenAI's
    for prompt in (["a", "b"], [1 << 64]):
        err = rejected(convert.completion_call, CompletionRequest(model="m", prompt=prompt))
        assert err.param == "prompt"
    call = convert.completion_call(CompletionRequest(model="m", prompt="x", logprobs=0))
    assert call.logprobs and call.kwargs["logprobs"] == 0 and call.request_id.startswith("cmpl-")
    for field, value in (("echo", True), ("suffix", "s"), ("best_of", 3)):
        req = CompletionRequest(model="m", prompt="x", **{field: value})
        assert rejected(convert.completion_call, req).param == field


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, message, status, param",
    [
        ("INVALID_ARGUMENT", "sampling.temperature: must be in [0, 2]", 400, "temperature"),
        ("INVALID_ARGUMENT", "tokens.token_ids: id 9999 outside", 400, "prompt"),
        ("INVALID_ARGUMENT", "text: must not be empty", 400, "prompt"),
        ("INVALID_ARGUMENT", "chat.messages[1].role: must be one of", 400, "messages[1].role"),
        ("INVALID_ARGUMENT", "no field named here", 400, None),
        ("RESOURCE_EXHAUSTED", "1024 requests are queued", 429, None),
        ("UNAVAILABLE", "no live worker serves requests", 503, None),
        ("DEADLINE_EXCEEDED", "Deadline Exceeded", 504, None),
        ("INTERNAL", "boom", 500, None),
    ],
)
def test_grpc_errors_map_to_openai_errors(code, message, status, param):
    err = from_client_error(ClientError(code, message))
    assert (err.status, err.param) == (status, param)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["message"].startswith(f"{param}: ")
    if status == 429:
        assert body["code"] == "rate_limit_exceeded"


def test_param_names_follow_what_the_request_used():
    overrides = {"max_tokens": "max_completion_tokens"}
    assert param_for("sampling.max_tokens", overrides) == "max_completion_tokens"
    assert param_for("sampling.max_tokens") == "max_tokens"
    err = from_client_error(ClientError("INVALID_ARGUMENT", "sampling.logprobs: <= 20"), {
        "logprobs": "top_logprobs"
    })  # fmt: skip
    assert err.param == "top_logprobs"


def test_body_validation_errors_name_the_field():
    assert loc_to_param(("body", "messages", 0, "role")) == "messages[0].role"
    assert loc_to_param(("body", "prompt", "list[int]", 0)) == "prompt"
    assert loc_to_param(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert loc_to_param(("body",)) is None
    err = body_error([{"type": "missing", "loc": ("body", "model"), "msg": "Field required"}])
    assert (err.status, err.param, err.message) == (400, "model", "model: Field required")
    assert body_error([{"type": "json_invalid", "loc": ("body", 3), "msg": "x"}]).param is None


# ---- responses ----------------------------------------------------------------------------


def lp(token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, 1, [t for t, _ in top], [v for _, v in top])


def test_chat_response_shape_usage_and_logprobs(speller):
    call = convert.chat_call(chat(n=2, logprobs=True, top_logprobs=1))
    result = GenerateResult(
        "rid",
        [
            Completion(0, "hi", [104, 105], [lp(104, -0.1, [(104, -0.1)]), lp(105, -0.2, [])],
                       "length"),
            Completion(1, "h", [104], [lp(104, -0.3, [(120, -0.05)])], "stop"),
        ],
        Usage(prompt_tokens=9, completion_tokens=3, cached_prompt_tokens=4),
    )  # fmt: skip
    out = convert.response(call, "served", result, speller)
    assert out["object"] == "chat.completion" and out["model"] == "served"
    assert out["id"] == call.request_id and isinstance(out["created"], int)
    assert out["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    c0, c1 = out["choices"]
    assert c0["message"] == {"role": "assistant", "content": "hi"}
    assert (c0["finish_reason"], c1["finish_reason"]) == ("length", "stop")
    first = c0["logprobs"]["content"][0]
    assert first == {
        "token": "h",
        "logprob": -0.1,
        "bytes": [104],
        "top_logprobs": [{"token": "h", "logprob": -0.1, "bytes": [104]}],
    }
    assert c1["logprobs"]["content"][0]["top_logprobs"][0]["token"] == "x"


def test_completion_logprobs_offsets_and_top(speller):
    lps = [lp(97, -1.0, [(98, -0.5)]), lp(99, -2.0, [(99, -2.0)])]
    out = convert.completion_logprobs(lps, speller, text_offset=5)
    assert out["tokens"] == ["a", "c"] and out["token_logprobs"] == [-1.0, -2.0]
    assert out["text_offset"] == [5, 6]
    assert out["top_logprobs"] == [{"b": -0.5, "a": -1.0}, {"c": -2.0}]  # sampled always listed


def test_stream_chunks_roles_skips_and_offsets(speller):
    chat_call = convert.chat_call(chat(n=2, stream=True, stream_options={"include_usage": True}))
    b = ChunkBuilder(chat_call, "served", speller)
    opening = b.opening()
    assert [c["choices"][0]["index"] for c in opening] == [0, 1]
    assert opening[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in opening)
    assert b.delta(Delta(0, "", [226])) is None  # text held back, nothing to show yet
    last = b.delta(Delta(1, "", [], finish_reason="stop"))["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"

    comp: Call = convert.completion_call(
        CompletionRequest(model="m", prompt="x", logprobs=0, stream=True)
    )
    b = ChunkBuilder(comp, "served", speller)
    assert b.opening() == []
    first = b.delta(Delta(0, "ab", [97, 98], logprobs=[lp(97, -1, []), lp(98, -1, [])]))
    second = b.delta(Delta(0, "c", [99], logprobs=[lp(99, -1, [])], finish_reason="length"))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    assert second["choices"][0]["text"] == "c" and "usage" not in second


def test_token_bytes_of_partial_characters(speller):
    assert _byte_level_alphabet() == {ch: b for b, ch in bytes_to_unicode().items()}
    # "é" is two bytes, two tokens here: each alone decodes to U+FFFD but keeps its byte.
    first, second = "é".encode()
    assert speller.spell(first) == ("\ufffd", [first])
    assert speller.spell(second) == ("\ufffd", [second])
    assert speller.spell(32) == (" ", [32])
    assert speller.spell(258) == ("<|im_end|>", list(b"<|im_end|>"))

    class ByteFallback:  # SentencePiece-style byte pieces
        def decode(self, ids, skip_special_tokens=False):
            return "\ufffd"

        def convert_ids_to_tokens(self, token_id):
            return "<0xE2>"

    assert TokenSpeller(ByteFallback()).spell(7) == ("\ufffd", [0xE2])


def test_chat_prompt_length_is_the_template_rendering(speller):
    messages = [{"role": "user", "content": "hi"}]
    # <|im_start|> "user\nhi" <|im_end|> "\n" <|im_start|> "assistant\n": 3 specials + 18 bytes
    assert speller.chat_prompt_len(messages) == 21
    assert speller.chat_prompt_len(messages, add_generation_prompt=False) == 10


def test_the_user_field_names_the_session_for_routing():
    assert convert.chat_call(chat(user="alice")).kwargs["session_id"] == "alice"
    assert convert.chat_call(chat()).kwargs["session_id"] == ""
    call = convert.completion_call(CompletionRequest(model="m", prompt="x", user="bob"))
    assert call.kwargs["session_id"] == "bob"
