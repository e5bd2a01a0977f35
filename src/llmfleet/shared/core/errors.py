"""Typed errors shared by every service.

Core code raises these; servicers map them to gRPC status codes at the boundary
(ValidationError -> INVALID_ARGUMENT, CapacityError -> RESOURCE_EXHAUSTED).
"""

from __future__ import annotations


class LLMFleetError(Exception):
    """Base class of every error llmfleet raises on purpose."""


class ValidationError(LLMFleetError, ValueError):
    """A request parameter is out of range. `field` names the parameter as the API spells it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CapacityError(LLMFleetError):
    """The server cannot take this request now (queue full, no KV memory for it at all).

    `retry_after_s`: when a retry may succeed (sent as gRPC retry pushback / HTTP Retry-After).
    """

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(LLMFleetError):
    """A model directory or file cannot be loaded (missing files, unsupported architecture)."""
