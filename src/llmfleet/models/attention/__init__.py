"""Attention backends over the paged KV cache: the metadata a step carries, the PyTorch
reference, the Triton backend, and the selector that picks one per device."""
