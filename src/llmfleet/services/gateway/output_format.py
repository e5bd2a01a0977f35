"""An output format given flat — `{"type": "text" | "json_object" | "json_schema", "schema"}`,
as the Responses API's `text.format` and Anthropic's `output_config.format` give it — as a
`StructuredOutput` constraint, read by guided.py as chat's `response_format` is, with errors
naming the field where the client wrote it (`text.format.schema`)."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from llmfleet.services.gateway import guided
from llmfleet.services.gateway.errors import from_validation, invalid
from llmfleet.shared.core.errors import ValidationError
from llmfleet.v1 import common_pb2

_NO_GUIDED = dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar"))


def format_constraint(
    fmt: Any, field: str
) -> tuple[common_pb2.StructuredOutput | None, str | None]:
    """(the constraint, the field to blame for its errors); (None, None) for plain text or no
    format. `field` is where `fmt` sits in the body ("text.format")."""
    if fmt is None:
        return None, None
    if not isinstance(fmt, Mapping):
        raise invalid(field, f"{field}: must be an object")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), Mapping):
            raise invalid(f"{field}.schema", f"{field}.schema: must be a JSON Schema object")
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    as_chat = SimpleNamespace(response_format=fmt, structured_outputs=None, **_NO_GUIDED)
    try:
        so, _ = guided.structured_output(as_chat)
    except ValidationError as exc:  # response_format.json_schema.schema -> <field>.schema
        name = exc.field.replace("response_format", field).replace(".json_schema.", ".")
        raise from_validation(ValidationError(name, exc.message)) from None
    if so is None:
        return None, None
    return so, (f"{field}.schema" if so.WhichOneof("kind") == "json_schema" else field)


def constrain(kwargs: dict[str, Any], params: dict[str, str], fmt: Any, field: str) -> None:
    """Put `fmt`'s constraint in a call's `kwargs` (and its error names in `params`); a 400
    when a forced tool choice has constrained the call already."""
    so, blame = format_constraint(fmt, field)
    if so is None or blame is None:
        return
    if "structured_output" in kwargs:
        raise invalid(field, f"{field} cannot be combined with a forced tool choice")
    kwargs["structured_output"] = so
    params.update(guided.error_params(blame))
