"""Python APIs: `generation` (sync and async gRPC clients of a fleet's public API; grpc and
protobuf only, no torch) and `llm` (the engine in-process, no fleet)."""
