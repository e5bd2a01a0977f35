"""Shared test configuration.

Tests marked `gpu` need CUDA: on a machine without it (CI, developer laptops) they are
deselected with a visible reason; run them on the GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Two cores on CI: one intra-op thread per test process keeps timings stable and avoids
# oversubscription when the suite runs tests in parallel.
torch.set_num_threads(int(os.environ.get("LLMFLEET_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run with `pytest -m gpu` on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def make_checkpoint() -> Callable[..., Path]:
    """`make_checkpoint(arch, tmp_path, *, max_shard_size=None, **config_overrides) -> Path`:
    a tiny random-weight HF checkpoint (see tiny_models.py)."""
    from tiny_models import make_checkpoint  # imported lazily: it needs transformers and gguf

    return make_checkpoint


@pytest.fixture(scope="module")
def make_checkpoint_module(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Module-scoped variant: `make_checkpoint_module(arch, **config_overrides) -> Path`."""

    from tiny_models import make_checkpoint

    def make(arch: str, **overrides) -> Path:
        return make_checkpoint(arch, tmp_path_factory.mktemp("ckpt"), **overrides)

    return make


@pytest.fixture(scope="session")
def bundled_hf_model() -> torch.nn.Module:
    """transformers' float32 model of the bundled GGUF (dequantized), the reference the
    bundled-model tests compare against: loaded once per session (about 20 s on two cores).
    Read-only: tests must not change its weights or config."""
    from transformers import AutoModelForCausalLM

    from llmfleet.models.checkpoint_files import resolve_model_path

    path = resolve_model_path(None)
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
