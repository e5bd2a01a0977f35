"""Model definitions (Llama family, Qwen2/3, Mixtral, Qwen3-MoE), weight loading from HF
safetensors and GGUF, quantized linears (FP8, INT4), attention backends (`attention`)."""
