"""`/v1/embeddings` with the official `openai` SDK and gRPC `Embed` through the router, against a
fleet started by `llmfleet up` (one unified worker on a tiny llama checkpoint that declares
Matryoshka dimensions). Vectors are checked against transformers' pooled hidden states; the
worker must hold no KV and no prefix-cache block afterwards."""

from __future__ import annotations

import base64

import grpc
import numpy as np
import openai
import pytest
import torch
from gateway_helpers import llmfleet_up, wait_workers_idle
from transformers import AutoModel, AutoTokenizer

from llmfleet.client.generation import ClientError, GenerationClient
from llmfleet.v1 import embedding_pb2, worker_pb2, worker_pb2_grpc

CONTEXT = 128
TEXTS = ["the quick brown fox", "jumps over the lazy dog again and again", "hi"]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint_module):
    return make_checkpoint_module(
        "llama", max_position_embeddings=CONTEXT, matryoshka_dimensions=[16, 32]
    )


@pytest.fixture(scope="module")
def up(checkpoint, tmp_path_factory):
    with llmfleet_up(str(checkpoint), tmp_path_factory.mktemp("logs"), {}) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def oai(up):
    return openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(checkpoint):
    tok = AutoTokenizer.from_pretrained(checkpoint)
    return tok, AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()


def reference(hf, ids: list[int], pooling: str = "last", dims: int | None = None) -> np.ndarray:
    with torch.inference_mode():
        h = hf[1](torch.tensor([ids])).last_hidden_state[0]
    v = h[-1] if pooling == "last" else h.mean(dim=0)
    return torch.nn.functional.normalize(v[:dims] if dims else v, dim=0).numpy()


def test_batch_of_texts_in_order_float_and_base64_agree(oai, model, hf):
    res = oai.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert res.object == "list" and res.model == model
    assert [d.index for d in res.data] == [0, 1, 2]
    token_ids = [hf[0](t).input_ids for t in TEXTS]
    for d, ids in zip(res.data, token_ids, strict=True):
        np.testing.assert_allclose(d.embedding, reference(hf, ids), atol=1e-4)
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, token_ids))
    # The SDK's default asks for base64 and decodes it (little-endian float32).
    b64 = oai.embeddings.create(model=model, input=TEXTS)
    for a, b in zip(res.data, b64.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    raw = oai.embeddings.with_raw_response.create(
        model=model, input="hi", encoding_format="base64"
    ).http_response.json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    np.testing.assert_allclose(decoded, res.data[2].embedding, atol=1e-6)


def test_token_inputs_mean_pooling_and_dimensions(oai, model, hf):
    ids = [hf[0]("a b c d e f").input_ids, [5, 6, 7]]
    res = oai.embeddings.create(model=model, input=ids, encoding_format="float")
    for d, x in zip(res.data, ids, strict=True):
        np.testing.assert_allclose(d.embedding, reference(hf, x), atol=1e-4)
    [one] = oai.embeddings.create(
        model=model, input=ids[1], encoding_format="float", extra_body={"pooling": "mean"}
    ).data
    np.testing.assert_allclose(one.embedding, reference(hf, ids[1], "mean"), atol=1e-4)
    short = oai.embeddings.create(model=model, input=ids, dimensions=16, encoding_format="float")
    assert [len(d.embedding) for d in short.data] == [16, 16]
    np.testing.assert_allclose(short.data[0].embedding, reference(hf, ids[0], dims=16), atol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty"),
        ({"input": ["ok", ""]}, "input[1]", "empty"),
        ({"input": ["ok", "word " * (2 * CONTEXT)]}, "input[1]", "context length"),
        ({"input": [[1, 2], [10**7]]}, "input[1]", "vocabulary"),
        ({"input": [3, -1]}, "input", "non-negative"),
        ({"input": "ok", "dimensions": 20}, "dimensions", "matryoshka"),
        ({"input": "ok", "dimensions": 0}, "dimensions", "at least 1"),
    ],
)
def test_invalid_requests_are_400_naming_the_field(oai, model, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        oai.embeddings.create(model=model, encoding_format="float", **kwargs)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param, body
    assert words in body["message"] and body["message"].startswith(param)


def test_grpc_embed_through_the_router(up, hf):
    ids = hf[0](TEXTS[1]).input_ids
    req = embedding_pb2.EmbedRequest(
        inputs=[
            embedding_pb2.EmbedInput(text=TEXTS[1]),
            embedding_pb2.EmbedInput(tokens=embedding_pb2.EmbedTokens(token_ids=ids)),
        ],
        pooling=embedding_pb2.POOLING_MEAN,
    )
    with GenerationClient(up.endpoint) as client:
        resp = client.embed(req, timeout=60)
        assert resp.request_id and resp.num_prompt_tokens == 2 * len(ids)
        a, b = (np.array(e.values) for e in resp.embeddings)
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(a, reference(hf, ids, "mean"), atol=1e-4)
        req.inputs.append(embedding_pb2.EmbedInput(text="word " * (2 * CONTEXT)))
        with pytest.raises(ClientError) as err:
            client.embed(req, timeout=60)
    assert err.value.code_name == grpc.StatusCode.INVALID_ARGUMENT.name
    assert err.value.message.startswith("inputs[2]: ")


def test_no_kv_is_kept_after_embeddings(up, oai, model):
    oai.embeddings.create(model=model, input=TEXTS * 4, encoding_format="float")
    [load] = wait_workers_idle(up.worker_addresses, timeout_s=30)
    assert load.num_running == load.num_waiting == 0
    assert load.num_free_blocks == load.num_total_blocks > 0
    with grpc.insecure_channel(up.worker_addresses[0]) as ch:
        snap = worker_pb2_grpc.WorkerStub(ch).GetKVSnapshot(worker_pb2.GetKVSnapshotRequest())
    assert list(snap.block_hashes) == []  # nothing entered the prefix cache
