"""Shared test configuration.

Tests marked `gpu` need CUDA: on a machine without it (CI, developer laptops) they are
deselected with a visible reason; run them on the GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import os

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
