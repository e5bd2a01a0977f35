"""The gateway tests' shared fleet: one `llmfleet up` on the bundled model for every module
that drives it through the official clients (tool calling, the Responses API, Anthropic
Messages), started once for this package instead of once per module. `oai` and `model` are
that fleet's; a module with a fleet of its own defines its own `oai` and `model`."""

from __future__ import annotations

import openai
import pytest
from gateway_helpers import llmfleet_up

from llmfleet.models.checkpoint_files import resolve_model_path


@pytest.fixture(scope="package")
def bundled_fleet(tmp_path_factory: pytest.TempPathFactory):
    """`llmfleet up` (one worker, no kvstore) serving the bundled SmolLM2-135M-Instruct."""
    model = str(resolve_model_path(None))
    with llmfleet_up(model, tmp_path_factory.mktemp("bundled-fleet-logs"), {}) as fleet:
        yield fleet


@pytest.fixture(scope="package")
def oai(bundled_fleet) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=bundled_fleet.base_url, api_key="unused", max_retries=0, timeout=300
    )


@pytest.fixture(scope="package")
def model(oai) -> str:
    return oai.models.list().data[0].id
