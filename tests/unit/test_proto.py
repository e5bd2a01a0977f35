"""The wire contract: generated code is fresh, and the protos follow the conventions."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
GEN = ROOT / "src"
_spec = importlib.util.spec_from_file_location("proto_generate", PROTO / "generate.py")
_generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_generate)
generate = _generate.generate


def test_generated_code_is_not_stale(tmp_path):
    fresh = generate(PROTO, tmp_path)
    rel = sorted(p.relative_to(tmp_path) for p in fresh)
    committed = sorted(p.relative_to(GEN) for p in (GEN / "llmfleet" / "v1").glob("*.py*"))
    assert rel == committed, "generated file set differs: run `make proto`"
    for r in rel:
        assert (tmp_path / r).read_bytes() == (GEN / r).read_bytes(), f"{r} is stale: make proto"


def test_proto_conventions():
    for path in sorted((PROTO / "llmfleet" / "v1").glob("*.proto")):
        text = path.read_text()
        assert "package llmfleet.v1;" in text, path
        lines = text.splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            # Every field and enum value is documented by the comment line above it.
            if re.match(r"^(optional |repeated )?[\w.]+ \w+ = \d+;", s) or re.match(
                r"^[A-Z0-9_]+ = \d+;", s
            ):
                assert lines[i - 1].strip().startswith("//"), f"{path.name}:{i + 1} undocumented"
            m = re.match(r"^enum (\w+) \{", s)
            if m:
                first = lines[i + 2].strip()
                prefix = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", m.group(1))
                prefix = prefix.upper()
                assert first == f"{prefix}_UNSPECIFIED = 0;", f"{path.name}: {m.group(1)}"
            m = re.match(r"^rpc (\w+)\((stream )?(\w+)\) returns \((stream )?(\w+)\)", s)
            if m:
                assert m.group(3) == m.group(1) + "Request", s
                assert m.group(5) == m.group(1) + "Response", s
