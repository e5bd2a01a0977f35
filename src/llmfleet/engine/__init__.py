"""The engine core every worker role runs: block manager and prefix cache, batch scheduler,
model runner (CUDA graphs on GPU), sampler, and the KV hooks for disaggregation."""
