"""Tracing tests: an in-memory span exporter on this process's tracer provider.

The OpenTelemetry API allows one global provider per process. The first tracing test installs
an SDK provider (unless one is there already) and an in-memory exporter on it; at the end of
the session the exporter is shut down, so spans made by later tests are dropped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def span_exporter() -> InMemorySpanExporter:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()
