"""Triton kernels, one op per module, each with a PyTorch reference of the same function;
`dispatch` picks Triton on GPU and the reference on CPU. Tuned configurations per device live
in `configs/` (written by the tuners under benchmarks/kernels/)."""
