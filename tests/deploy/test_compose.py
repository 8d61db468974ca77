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
    services = document["services"]
    for role in ("gateway", "prefill", "decode"):
        assert services[role]["command"][:2] == ["serve", role]
    # Workers must register an address that reaches this replica, not the service name.
    for role in ("prefill", "decode", "colocated"):
        assert services[role]["environment"]["NORI_ADVERTISE_HOST"] == "auto"
        assert services[role]["environment"]["REDIS_URL"].startswith("redis://redis:")
    assert "--colocated" in services["colocated"]["command"]
    assert services["gateway"]["ports"] == ["${NORI_PORT:-8000}:8000"]


def test_every_role_command_parses_with_the_real_cli() -> None:
    from nori.cli.main import build_parser

    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name, service in document["services"].items():
        if name == "redis":
            continue
        command = [part.replace("${NORI_MODEL:-demo}", "demo") for part in service["command"]]
        args = build_parser().parse_args(command)
        assert callable(args.handler), name


def test_schema_check_rejects_a_broken_file() -> None:
    if not SCHEMA.exists():
        pytest.skip(f"Compose schema not found at {SCHEMA}")
    broken = {"services": {"generate": {"image": "nori", "comand": ["generate"]}}}
    with pytest.raises(jsonschema.ValidationError, match="comand"):
        validator(SCHEMA).validate(broken)
