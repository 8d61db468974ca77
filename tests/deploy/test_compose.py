"""compose.yaml is valid under the Compose Specification (no Docker engine runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"


def validator(path: Path) -> jsonschema.Draft7Validator:
    # The file names draft-07 in a form jsonschema does not recognise; say it explicitly.
    return jsonschema.Draft7Validator(json.loads(path.read_text()))


def test_compose_file_matches_the_compose_specification() -> None:
    if not SCHEMA.exists():
        pytest.skip(f"Compose schema not found at {SCHEMA}")
    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    validator(SCHEMA).validate(document)
    for name, service in document["services"].items():
        assert service["command"][0] in {"generate", "bench"}, name


def test_schema_check_rejects_a_broken_file() -> None:
    if not SCHEMA.exists():
        pytest.skip(f"Compose schema not found at {SCHEMA}")
    broken = {"services": {"generate": {"image": "nori", "comand": ["generate"]}}}
    with pytest.raises(jsonschema.ValidationError, match="comand"):
        validator(SCHEMA).validate(broken)
