"""Core types: sampling parameters, model info, logprobs, errors, configuration, block hashing,
the KV-holder index. Plain Python (torch only where a type names a dtype); imports neither grpc
nor protobuf, so policy code built on it is unit-tested in milliseconds."""
