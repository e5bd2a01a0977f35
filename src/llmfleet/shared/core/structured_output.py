"""A request's output constraint (JSON Schema, JSON object, regex, choice list, EBNF grammar).

Plain data: `__post_init__` checks what can be checked without a grammar compiler (the kind,
that a schema is JSON, that choices are non-empty strings). Compiling the grammar — which finds
unsupported schema features and bad regexes or EBNF — happens in the engine
(`llmfleet.engine.structured`); both raise `ValidationError` named
`structured_output.<kind>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmfleet.shared.core.errors import ValidationError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a bound on grammar compile work per request


@dataclass(frozen=True)
class StructuredOutput:
    """`kind` is one of KINDS; `spec` holds the schema/regex/grammar text (empty for
    json_object and choice); `choices` holds the strings of a choice constraint."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind not in KINDS:
            raise ValidationError(
                "structured_output", f"unknown kind {self.kind!r}; expected one of {KINDS}"
            )
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValidationError(self.field, f"longer than {MAX_SPEC_CHARS} characters")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise ValidationError(self.field, f"not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValidationError(self.field, "a JSON Schema must be an object or a boolean")
        elif self.kind in ("regex", "grammar") and not self.spec:
            raise ValidationError(self.field, "must not be empty")
        elif self.kind == "choice":
            if not self.choices:
                raise ValidationError(self.field, "needs at least one choice")
            for c in self.choices:
                if not isinstance(c, str) or c == "":
                    raise ValidationError(self.field, "choices must be non-empty strings")

    @property
    def field(self) -> str:
        """The field path the public API uses for this constraint."""
        return f"structured_output.{self.kind}"

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """Identity of the compiled grammar (the grammar cache key)."""
        return (self.kind, self.spec, self.choices)


def parse_grammar(s: StructuredOutput) -> Any:
    """`s` as an `xgrammar.Grammar`, checked without a vocabulary (what the router can check);
    raises ValidationError naming `structured_output.<kind>` and xgrammar's reason.

    xgrammar is imported here, not at module load, so plain users of the dataclass stay light.
    """
    import xgrammar as xgr

    if s.kind == "json_schema":
        where = unsupported_schema_feature(json.loads(s.spec))
        if where is not None:
            raise ValidationError(s.field, f"unsupported JSON schema feature {where}")
    try:
        if s.kind == "json_schema":
            return xgr.Grammar.from_json_schema(s.spec)
        if s.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}')
        if s.kind == "regex":
            return xgr.Grammar.from_regex(s.spec)
        if s.kind == "choice":
            # ensure_ascii: GBNF string literals take JSON's escapes (\", \\, \n, \u + 4 hex).
            alternatives = " | ".join(json.dumps(c, ensure_ascii=True) for c in s.choices)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(s.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValidationError(s.field, f"invalid {_WHAT[s.kind]}: {xgrammar_reason(e)}") from None


def unsupported_schema_feature(schema: object, path: str = "") -> str | None:
    """The first keyword of `schema` that xgrammar would silently ignore (so outputs might not
    validate), as `"keyword" at /json/pointer`; None when there is none."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unsupported_schema_feature(item, f"{path}/{i}")
            if found is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        here = f"{path}/{key}"
        if key in _IGNORED_KEYWORDS and (key != "uniqueItems" or value is True):
            return f'"{key}" at {here}'
        if key == "format" and isinstance(value, str) and value not in _FORMATS:
            return f'"format": "{value}" at {here}'
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            if isinstance(value, dict):  # names here are property names, not keywords
                for name, sub in value.items():
                    found = unsupported_schema_feature(sub, f"{here}/{name}")
                    if found is not None:
                        return found
            continue
        if key not in ("enum", "const", "default", "examples") and isinstance(value, dict | list):
            found = unsupported_schema_feature(value, here)
            if found is not None:
                return found
    return None


# Keywords and string formats that xgrammar 0.2 parses but does not enforce.
_IGNORED_KEYWORDS = frozenset({"not", "uniqueItems"})
_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip


def xgrammar_reason(e: BaseException) -> str:
    """xgrammar's message without its `[time] /path/file.cc:line: ` prefix."""
    return _LOCATION.sub("", str(e)).strip()


_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "EBNF grammar",
}
_LOCATION = re.compile(r"\[[0-9:]+\] \S+\.(cc|h):\d+: ")
