"""The worker service: one engine core serving a role (unified, prefill, decode) over gRPC,
with per-step token batches and KV blocks on the ZMQ data plane."""
