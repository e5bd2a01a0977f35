"""GGUF loading: a tiny llama written with gguf.GGUFWriter, and the bundled SmolLM2 (slow)."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import (
    CHAT_TEMPLATE,
    PROMPT_LENS,
    SPECIALS,
    Runner,
    assert_logits_close,
    build_hf_model,
    bytes_to_unicode,
    random_prompts,
    save_checkpoint,
)

from llmfleet.models.loader import load_model
from llmfleet.shared.core.errors import ModelLoadError

Q = gguf.GGMLQuantizationType
# One weight type per projection so every supported type is exercised.
QUANT_OF = {
    "token_embd": Q.F16,
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q4_1,
    "attn_output": Q.BF16,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_0,
    "output": Q.F16,
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's converter does to llama q/k rows: per head (2, D/2) -> (D/2, 2).
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_llama_gguf(
    hf: torch.nn.Module, path: Path, quant_of: dict[str, gguf.GGMLQuantizationType] | None = None
) -> dict[str, torch.Tensor]:
    """Write `hf` as a llama GGUF (2-D tensors typed by `quant_of`, default QUANT_OF);
    returns the HF-named weights as they round-trip."""
    quant_of = QUANT_OF if quant_of is None else quant_of
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    tokens = [ch for _, ch in sorted(bytes_to_unicode().items())] + list(SPECIALS)
    tokens += [f"<|unused{i}|>" for i in range(cfg.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (len(tokens) - 256))
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(256)
    w.add_chat_template(CHAT_TEMPLATE)

    expected = {}
    tied = cfg.tie_word_embeddings
    for name, t in hf.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        arr = t.float().numpy()
        gname = _gguf_name(name)
        qtype = quant_of.get(gname.split(".")[-2], Q.F32) if arr.ndim == 2 else Q.F32
        data = gguf.quants.quantize(arr, qtype)
        expected[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
        if name.endswith("q_proj.weight"):
            data = gguf.quants.quantize(_llamacpp_permute(arr, cfg.num_attention_heads), qtype)
        elif name.endswith("k_proj.weight"):
            data = gguf.quants.quantize(_llamacpp_permute(arr, cfg.num_key_value_heads), qtype)
        w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_matches_safetensors(tmp_path: Path, monkeypatch, tied: bool) -> None:
    monkeypatch.setenv("LLMFLEET_CACHE_DIR", str(tmp_path / "cache"))
    hf = build_hf_model("llama_tied" if tied else "llama")
    gguf_path = tmp_path / "tiny.gguf"
    expected = write_tiny_llama_gguf(hf, gguf_path)

    # The same (dequantized) weights as an ordinary checkpoint.
    with torch.no_grad():
        for name, p in hf.named_parameters():  # a tied lm_head is not listed separately
            p.copy_(expected[name])
    ref = load_model(str(save_checkpoint(hf, tmp_path / "ref")), progress=False)
    loaded = load_model(str(gguf_path), progress=False)

    assert loaded.spec.architecture == "LlamaForCausalLM"
    assert loaded.spec.model_id == "tiny"
    assert loaded.spec.max_model_len == 256
    assert 256 in loaded.spec.eos_token_ids and 258 in loaded.spec.eos_token_ids
    assert (loaded.model.lm_head is None) == tied
    ours, theirs = loaded.model.state_dict(), ref.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name

    prompts = random_prompts(loaded.spec.vocab_size)
    a = Runner(loaded, PROMPT_LENS).step(prompts, [0, 0, 0])
    b = Runner(ref, PROMPT_LENS).step(prompts, [0, 0, 0])
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    # Tokenizer came from the GGUF metadata and was cached for the next load.
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") == 258
    assert list((tmp_path / "cache").glob("*/tokenizer/tokenizer_config.json"))


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture"):
        load_model(str(path), progress=False)


@pytest.mark.slow
def test_bundled_smollm2_matches_transformers(
    tmp_path: Path, monkeypatch, bundled_hf_model
) -> None:
    monkeypatch.setenv("LLMFLEET_CACHE_DIR", str(tmp_path / "cache"))
    start = time.perf_counter()
    first = load_model(None, progress=False)  # includes the one-time tokenizer conversion
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    loaded = load_model(None, progress=False)
    cached_s = time.perf_counter() - start
    assert first_s < 30 and cached_s < 30, (first_s, cached_s)
    del first

    info = loaded.spec
    assert info.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (30, 3, 64)
    assert info.max_model_len == 8192 and 2 in info.eos_token_ids

    tok = loaded.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok(ids, add_special_tokens=False).input_ids

    with torch.no_grad():
        ref = bundled_hf_model(torch.tensor([prompt])).logits[0]
    ours = Runner(loaded, [len(prompt)]).step([prompt], [0])[0]
    assert_logits_close(ours, ref)
    assert torch.equal(ours[-1].argmax(), ref[-1].argmax())
