"""Every RPC of every service in the contract has an implementation (the generated base
classes answer UNIMPLEMENTED, which a client must never see)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from llmfleet.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

BASES = {
    generation_pb2_grpc.GenerationServicer: generation_pb2.DESCRIPTOR.services_by_name[
        "Generation"
    ],
    registry_pb2_grpc.RegistryServicer: registry_pb2.DESCRIPTOR.services_by_name["Registry"],
    worker_pb2_grpc.WorkerServicer: worker_pb2.DESCRIPTOR.services_by_name["Worker"],
    kvstore_pb2_grpc.KVStoreServicer: kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"],
    tokenizer_pb2_grpc.TokenizerServicer: tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"],
}
SERVERS = {
    "llmfleet.services.router.server": {"Generation", "Registry"},
    "llmfleet.services.worker.server": {"Worker"},
    "llmfleet.services.kvstore.server": {"KVStore"},
    "llmfleet.services.tokenizer.server": {"Tokenizer"},
}


@pytest.mark.parametrize("module", sorted(SERVERS))
def test_servicers_implement_every_rpc(module):
    mod = importlib.import_module(module)
    found = set()
    for _, cls in inspect.getmembers(mod, inspect.isclass):
        for base, desc in BASES.items():
            if issubclass(cls, base) and cls is not base and cls.__module__ == module:
                found.add(desc.name)
                missing = [
                    m.name for m in desc.methods if getattr(cls, m.name) is getattr(base, m.name)
                ]
                assert missing == [], f"{cls.__name__} does not implement {missing}"
    assert found == SERVERS[module]
