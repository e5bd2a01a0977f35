"""llmfleet: an LLM inference server built as a fleet of gRPC services.

Packages are layers; a module imports only from its own layer or the layers below it
(`tests/unit/test_layering.py` checks this on the real import graph):

    shared.core   domain types, errors, config, block hashing (no grpc, no protobuf)
    shared.wire   proto <-> core conversions, ZMQ framing, KV events, service shell, tracing
                  (with `v1`, the generated protobuf code)
    kernels       Triton kernels, their PyTorch references, dispatch
    models        model definitions, weight loading, quantized linears, attention backends
    engine        block manager, batch scheduler, model runner, sampler, KV hooks
    text          chat rendering, tokenizer loading, incremental detokenization
    client        the gRPC clients of a fleet and the in-process `LLM`
    services      gateway, router, tokenizer, worker, kvstore; none imports another
    cli           the `llmfleet` command, the fleet launcher, `bench serve`

docs/architecture.md describes how the services fit together.
"""
