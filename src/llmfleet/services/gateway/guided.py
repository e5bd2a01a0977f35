"""Output constraints of a request body -> `SamplingParams.structured_output`.

Accepted (at most one per request; a second is a 400 naming it):
- OpenAI `response_format`: {"type": "text"} (none), {"type": "json_object"}, {"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}} (no schema: any JSON object);
- vLLM's extra fields `guided_json` (a schema, as an object or JSON text), `guided_regex`,
  `guided_choice` (a list of strings), `guided_grammar` (GBNF, root rule `root`);
- vLLM's newer `structured_outputs` object with one of `json`, `regex`, `choice`, `grammar`,
  `json_object`.

A schema that is not a JSON Schema is refused here; whether the engine supports every feature
of a valid one is the router's to say (INVALID_ARGUMENT naming `sampling.structured_output.<kind>`,
which `params` maps back to the field the client used).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema

from llmfleet.shared.core.errors import ValidationError
from llmfleet.v1 import common_pb2

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_STRUCTURED_KEYS = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def error_params(param: str) -> dict[str, str]:
    """Call.params entries blaming `param` for any error of the constraint."""
    return {"structured_output": param} | {f"structured_output.{k}": param for k in KINDS}


def structured_output(body: Any) -> tuple[common_pb2.StructuredOutput | None, str | None]:
    """The constraint a body asks for and the field that asked (None, None: unconstrained)."""
    found: list[tuple[common_pb2.StructuredOutput, str]] = []
    if body.response_format is not None:
        so = _response_format(body.response_format)
        if so is not None:
            found.append((so, "response_format"))
    if body.guided_json is not None:
        found.append((_json_schema(body.guided_json, "guided_json"), "guided_json"))
    if body.guided_regex is not None:
        found.append((_regex(body.guided_regex, "guided_regex"), "guided_regex"))
    if body.guided_choice is not None:
        found.append((_choice(body.guided_choice, "guided_choice"), "guided_choice"))
    if body.guided_grammar is not None:
        found.append((_grammar(body.guided_grammar, "guided_grammar"), "guided_grammar"))
    if body.structured_outputs is not None:
        found.append(_structured_outputs(body.structured_outputs))
    if not found:
        return None, None
    if len(found) > 1:
        first, second = found[0][1], found[1][1]
        raise ValidationError(second, f"only one output constraint per request; {first} is set")
    return found[0]


def _response_format(rf: Mapping[str, Any]) -> common_pb2.StructuredOutput | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise ValidationError(
            "response_format.type",
            f"must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValidationError("response_format.json_schema", "must be an object with a schema")
    schema = spec.get("schema")
    if schema is None:
        return common_pb2.StructuredOutput(json_object=True)
    return _json_schema(schema, "response_format.json_schema.schema")


def _json_schema(schema: Any, field: str) -> common_pb2.StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValidationError(field, f"not JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise ValidationError(field, "must be a JSON Schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValidationError(field, f"not a valid JSON Schema: {exc.message}") from None
    return common_pb2.StructuredOutput(json_schema=json.dumps(schema))


def _regex(pattern: Any, field: str) -> common_pb2.StructuredOutput:
    if not isinstance(pattern, str) or not pattern:
        raise ValidationError(field, "must be a non-empty regular expression")
    return common_pb2.StructuredOutput(regex=pattern)


def _choice(choices: Any, field: str) -> common_pb2.StructuredOutput:
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValidationError(field, "must be a non-empty list of non-empty strings")
    return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=choices))


def _grammar(grammar: Any, field: str) -> common_pb2.StructuredOutput:
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValidationError(field, "must be a non-empty grammar")
    return common_pb2.StructuredOutput(grammar=grammar)


def _structured_outputs(so: Mapping[str, Any]) -> tuple[common_pb2.StructuredOutput, str]:
    keys = [k for k, v in so.items() if k in _STRUCTURED_KEYS and v not in (None, False)]
    if len(keys) != 1:
        raise ValidationError(
            "structured_outputs", f"set exactly one of {sorted(_STRUCTURED_KEYS)}, got {keys}"
        )
    key = keys[0]
    field = f"structured_outputs.{key}"
    value = so[key]
    if key == "json":
        return _json_schema(value, field), field
    if key == "json_object":
        return common_pb2.StructuredOutput(json_object=True), field
    if key == "regex":
        return _regex(value, field), field
    if key == "choice":
        return _choice(value, field), field
    return _grammar(value, field), field
