"""The engine core every worker role runs: block manager and prefix cache, batch scheduler,
model runner (CUDA graphs on GPU), sampler, async scheduling, and the KV handoff (export,
import, pins, reservations) for disaggregation and the kvstore."""
