"""The wire: the only protobuf <-> core conversions, ZMQ framing, KV events, the gRPC service
shell every service runs in, tracing and metrics helpers. No service logic."""
