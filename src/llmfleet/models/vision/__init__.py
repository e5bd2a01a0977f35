"""Vision encoders of vision-language models (plain PyTorch; replicated under tensor
parallelism)."""
