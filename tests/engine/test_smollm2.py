"""The bundled SmolLM2-135M-Instruct: greedy output equals transformers token for token.

transformers loads the same GGUF (dequantized to float32) as the reference.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llmfleet.client.llm import LLM
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash function is.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EngineConfig(), loaded=load_model(None, dtype=torch.float32, progress=False))


@pytest.fixture(scope="module")
def hf_model(bundled_hf_model):
    return bundled_hf_model  # (conftest.py: one load per session)


def test_chat_greedy_equals_transformers(llm, hf_model):
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    results = llm.generate(CHAT_PROMPTS, params, chat=True)  # one continuous batch
    for res in results:
        ids = torch.tensor([res.prompt_token_ids])
        with torch.inference_mode():
            ref = hf_model.generate(
                ids,
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
        assert res.completions[0].token_ids == ref


def test_chat_answer_is_sensible_and_stops_at_end_of_turn(llm):
    [res] = llm.generate(
        [CHAT_PROMPTS[0]], SamplingParams(max_tokens=48, temperature=0.0), chat=True
    )
    comp = res.completions[0]
    assert "Paris" in comp.text
    assert comp.finish_reason == "stop" and "<|im_end|>" not in comp.text


def test_logprobs_equal_log_softmax_of_reference_logits(llm, hf_model):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    [res] = llm.generate(["The three primary colors are"], params)
    comp = res.completions[0]
    ids = res.prompt_token_ids + comp.token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    n = len(res.prompt_token_ids)
    for k, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[n - 1 + k]
        assert lp.token_id == tok and lp.rank == 1
        assert lp.logprob == pytest.approx(row[tok].item(), abs=2e-3)
        top = torch.topk(row, 5)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=2e-3)


def test_stop_string_truncates_text(llm):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    [full] = llm.generate(["Count from one to ten: one, two,"], params)
    text = full.completions[0].text
    assert "five" in text
    stopped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["five"])
    [res] = llm.generate(["Count from one to ten: one, two,"], stopped)
    comp = res.completions[0]
    assert comp.finish_reason == "stop" and comp.stop_string == "five"
    assert comp.text == text[: text.index("five")]
    assert len(comp.token_ids) < 40
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_seeded_sampling_reproduces(llm):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    a = llm.generate(["Tell me a story."], params, chat=True)[0].completions[0].token_ids
    b = llm.generate(["Tell me a story."], params, chat=True)[0].completions[0].token_ids
    c = llm.generate(
        ["Tell me a story."],
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99),
        chat=True,
    )[0].completions[0]
    assert a == b and a != c.token_ids


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmfleet.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_prints_only_the_completion(llm):
    proc = _cli("generate", "--offline", "--max-tokens", "24", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    [expected] = llm.generate(
        ["What is the capital of France?"],
        SamplingParams(max_tokens=24, temperature=0.0),
        chat=True,
    )
    assert proc.stdout == expected.completions[0].text + "\n"


def test_cli_offline_at_tp2_prints_the_tp1_completion(llm):
    args = ("--max-tokens", "12", "What is the capital of France?")
    proc = _cli("generate", "--offline", "--tensor-parallel-size", "2", *args)
    assert proc.returncode == 0, proc.stderr
    [expected] = llm.generate([args[-1]], SamplingParams(max_tokens=12, temperature=0.0), chat=True)
    assert proc.stdout == expected.completions[0].text + "\n"


def test_cli_rejects_bad_input_with_the_field_named():
    proc = _cli("generate", "--offline", "--temperature", "3", "hi")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and proc.stdout == ""
