"""The kvstore service: content-addressed KV blocks shared by all workers (RAM and disk tiers)."""
