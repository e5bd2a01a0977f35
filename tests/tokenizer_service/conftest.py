"""Fixtures of the tokenizer service tests."""

from __future__ import annotations

from typing import Any

import pytest

from llmfleet.text.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(None)
