"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

gRPC status codes of the router map to HTTP statuses in one table (`_BY_GRPC_CODE`); an
overload (RESOURCE_EXHAUSTED) is a 429 with `Retry-After` from the router's retry pushback, a
message over gRPC's size limit a 413. The
router names a bad field by its path in `GenerateRequest` ("sampling.temperature: must be
..."); `param_for` turns that path into the OpenAI parameter the client sent ("temperature").
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from fastapi.responses import JSONResponse

from llmfleet.client.generation import ClientError
from llmfleet.shared.core.errors import ValidationError


class APIError(Exception):
    """An error answered to the HTTP client as is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


def from_validation(exc: ValidationError, params: Mapping[str, str] | None = None) -> APIError:
    """A locally raised ValidationError (`field` spelled as the client library spells it)."""
    param = param_for(exc.field, params)
    return invalid(param, f"{param}: {exc.message}")


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        param="model",
        code="model_not_found",
    )


# gRPC status name -> (HTTP status, OpenAI error type, OpenAI error code); RESOURCE_EXHAUSTED:
# `from_client_error`.
_BY_GRPC_CODE: dict[str, tuple[int, str, str | None]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "OUT_OF_RANGE": (400, "invalid_request_error", None),
    "NOT_FOUND": (404, "invalid_request_error", None),
    "UNAUTHENTICATED": (401, "invalid_request_error", "invalid_api_key"),
    "UNAVAILABLE": (503, "service_unavailable_error", "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout_error", "timeout"),
    "CANCELLED": (499, "cancelled", None),
}
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")
# gRPC's own answer to a message over a size limit ("Received message larger than max (N vs. M)")
_TOO_LARGE = re.compile(r"message larger than max", re.IGNORECASE)

# Paths in GenerateRequest -> OpenAI parameter names, for both endpoints.
# (Names not listed are the same on both sides; `chat.` paths drop the prefix.)
_PARAMS: dict[str, str] = {
    "text": "prompt",
    "tokens": "prompt",
    "tokens.token_ids": "prompt",
    "chat": "messages",
}


def param_for(path: str, overrides: Mapping[str, str] | None = None) -> str:
    """The OpenAI parameter of a field path ("sampling.max_tokens" -> "max_tokens").

    `overrides` maps sampling field names to the parameter this request used for them (e.g.
    "max_tokens" -> "max_completion_tokens", "logprobs" -> "top_logprobs" for chat).
    """
    name = path.removeprefix("sampling.")
    if overrides and name in overrides:
        return overrides[name]
    if name.startswith("chat."):  # chat.messages[0].role -> messages[0].role
        # A content part: chat.messages[1].parts[0] -> messages[1].content[0]
        return name.removeprefix("chat.").replace(".parts[", ".content[")
    return _PARAMS.get(name, name)


def rate_limited(message: str, retry_after_s: float | None) -> APIError:
    """A 429 with `Retry-After` (whole seconds, at least 1; 1 when the server named none)."""
    seconds = max(1, math.ceil(retry_after_s)) if retry_after_s is not None else 1
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


def from_client_error(exc: ClientError, params: Mapping[str, str] | None = None) -> APIError:
    """The HTTP answer to a failed Generate/GetModelInfo call."""
    if exc.code_name == "RESOURCE_EXHAUSTED":
        if _TOO_LARGE.search(exc.message):  # gRPC's message-size limit: no retry helps
            return APIError(413, exc.message, code="request_too_large")
        return rate_limited(exc.message, exc.retry_after_s)
    status, type_, code = _BY_GRPC_CODE.get(exc.code_name, (500, "server_error", None))
    param = None
    message = exc.message
    if status == 400:
        m = _FIELD.match(message)
        if m is not None:
            param = param_for(m.group(1), params)
            message = f"{param}: {message[m.end() :]}"
    return APIError(status, message, type=type_, param=param, code=code)
