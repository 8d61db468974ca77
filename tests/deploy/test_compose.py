"""compose.yaml is valid under the Compose Specification (no Docker engine runs here) and holds
what a deployment needs; `test_compose_processes.py` runs it."""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"


def validator(path: Path) -> jsonschema.Draft7Validator:
    # The file names draft-07 in a form jsonschema does not recognise; say it explicitly.
    return jsonschema.Draft7Validator(json.loads(path.read_text()))


def _document() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "compose.yaml").read_text()))


def test_compose_file_matches_the_compose_specification() -> None:
    if not SCHEMA.exists():
        pytest.skip(f"Compose schema not found at {SCHEMA}")
    document = _document()
    validator(SCHEMA).validate(document)
    services = document["services"]
    for role in ("gateway", "prefill", "decode"):
        assert services[role]["command"][:2] == ["serve", role]
    # Workers must register an address that reaches this replica, not the service name.
    for role in WORKERS:
        assert services[role]["environment"]["NORI_ADVERTISE_HOST"] == "auto"
        assert services[role]["environment"]["REDIS_URL"].startswith("redis://nori-")
        assert services[role]["environment"]["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == (
            "http://jaeger:4317"
        )
    assert "--colocated" in services["colocated"]["command"]
    assert services["gateway"]["ports"] == [
        "${NORI_BIND_ADDRESS:-127.0.0.1}:${NORI_PORT:-8000}:8000"
    ]


def test_the_file_suits_compose_1_29_and_stops_promptly() -> None:
    """Debian's docker-compose 1.29 refuses a top-level `name` (.env names the project); every
    service runs an init process; the UIs and the API are published on loopback by default; the
    gateway is given longer than its drain to stop."""
    document = _document()
    assert "name" not in document
    assert "COMPOSE_PROJECT_NAME=nori" in (ROOT / ".env").read_text().splitlines()
    for name, service in document["services"].items():
        assert service.get("init") is True, name
        for port in service.get("ports", []):
            assert port.startswith("${NORI_BIND_ADDRESS:-127.0.0.1}:"), (name, port)
    gateway = document["services"]["gateway"]
    drain_s = float(gateway["command"][gateway["command"].index("--drain-timeout-s") + 1])
    assert _seconds(gateway["stop_grace_period"]) > drain_s
    for name in ("prefill", "decode"):
        assert document["services"][name]["cpus"].startswith("${NORI_"), name


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert match is not None and duration, duration
    return 60 * int(match.group(1) or 0) + int(match.group(2) or 0)


def test_make_secrets_writes_every_secret_readable_by_the_image_user_in_a_private_folder(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "secrets"
    subprocess.run([str(ROOT / "deploy" / "make-secrets.sh"), str(folder)], check=True)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    declared = set(_document()["secrets"])
    assert {path.name for path in folder.iterdir()} == declared
    values = set()
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
        values.add(path.read_text())
    assert len(values) == len(declared)
    # Run again: the values stay.
    subprocess.run([str(ROOT / "deploy" / "make-secrets.sh"), str(folder)], check=True)
    assert {path.read_text() for path in folder.iterdir()} == values


WORKERS = ("prefill", "decode", "colocated", "prefill-gpu", "decode-gpu")


def test_only_the_gateway_and_the_uis_are_published_and_workers_stay_internal() -> None:
    document = _document()
    services = document["services"]
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"gateway", "jaeger", "prometheus", "grafana"}
    assert document["networks"]["internal"]["internal"] is True
    for name in (*WORKERS, "redis"):
        assert "container_name" not in services[name], name  # a name would forbid --scale
        assert services[name]["networks"] == ["internal"], name
    for name in WORKERS:
        # A fixed metrics port: Prometheus finds every replica by DNS on it.
        command = services[name]["command"]
        assert command[command.index("--metrics-port") + 1] == "9400", name


def test_every_nori_role_has_a_health_check_and_gpu_workers_reserve_gpus() -> None:
    services = _document()["services"]
    for name, service in services.items():
        if service.get("image") == "nori:latest" and "offline" not in service.get("profiles", []):
            test = service["healthcheck"]["test"]
            assert test[:3] == ["CMD", "nori", "health"], name
    for name in ("prefill-gpu", "decode-gpu"):
        assert services[name]["profiles"] == ["gpu"]
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
        assert "cuda" in services[name]["command"]


def test_prometheus_scrapes_every_role_by_dns() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["nori-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    for role in ("prefill", "decode", "colocated", "batch"):
        discovery = jobs[f"nori-{role}"]["dns_sd_configs"][0]
        assert role in discovery["names"] and discovery["port"] == 9400


def test_every_nori_service_command_parses_with_the_real_cli() -> None:
    from nori.cli.main import build_parser

    for name, service in _document()["services"].items():
        if service.get("image") != "nori:latest":
            continue
        command = [part.replace("${NORI_MODEL:-demo}", "demo") for part in service["command"]]
        args = build_parser().parse_args(command)
        assert callable(args.handler), name
        test = service.get("healthcheck", {}).get("test")
        if test:
            assert callable(build_parser().parse_args(test[2:]).handler), name


def test_the_grafana_dashboard_plots_only_metrics_that_exist() -> None:
    from nori.engine.outputs import EngineLoad
    from nori.gateway.middleware import GatewayMetrics
    from nori.worker.worker_metrics import WorkerMetrics

    worker = WorkerMetrics()
    worker.watch_engine(EngineLoad, lambda: 0)
    gateway = GatewayMetrics(frozenset())
    gateway.requests.labels("/v1/completions", "200").inc()  # a labelled family's first child
    exported = {
        sample.name
        for registry in (worker.registry, gateway.registry)
        for family in registry.collect()
        for sample in family.samples
    }
    # Histogram buckets appear once observed; the families declare them.
    exported |= {f"{name[: -len('_count')]}_bucket" for name in exported if name.endswith("_count")}
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "nori.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in expressions for name in re.findall(r"\bnori_\w+", expr)}
    assert len(used) >= 10
    assert used <= exported, sorted(used - exported)


def test_schema_check_rejects_a_broken_file() -> None:
    if not SCHEMA.exists():
        pytest.skip(f"Compose schema not found at {SCHEMA}")
    broken = {"services": {"generate": {"image": "nori", "comand": ["generate"]}}}
    with pytest.raises(jsonschema.ValidationError, match="comand"):
        validator(SCHEMA).validate(broken)


# The Redis user of each Nori service, and the secret holding its password.
REDIS_USERS = {
    "gateway": "nori-gateway",
    "prefill": "nori-prefill",
    "prefill-gpu": "nori-prefill",
    "decode": "nori-decode",
    "decode-gpu": "nori-decode",
    "colocated": "nori-decode",
    "batch": "nori-batch",
}


def test_every_role_gets_the_cluster_secret_and_only_its_own_redis_password() -> None:
    document = _document()
    services = document["services"]
    declared = document["secrets"]
    for name in (
        "cluster_secret",
        "redis_password",
        *(f"redis_{u[5:]}_password" for u in set(REDIS_USERS.values())),
    ):
        # File secrets, from one folder a variable can move.
        assert declared[name] == {"file": f"${{NORI_SECRETS_DIR:-./secrets}}/{name}"}, name
    for name, user in REDIS_USERS.items():
        service, password = services[name], f"redis_{user.removeprefix('nori-')}_password"
        environment = service["environment"]
        assert environment["REDIS_URL"] == f"redis://{user}@redis:6379/0", name
        assert environment["NORI_REDIS_PASSWORD_FILE"] == f"/run/secrets/{password}", name
        assert environment["NORI_CLUSTER_SECRET_FILE"] == "/run/secrets/cluster_secret", name
        # No other role's password, nor Redis' own: a role can log in only as itself.
        # The API key goes to the gateway, which requires it, and the batch runner, which sends it.
        api_key = ["api_key"] if name in ("gateway", "batch") else []
        assert sorted(service["secrets"]) == sorted(["cluster_secret", password, *api_key]), name
        if api_key:
            assert environment["NORI_API_KEY_FILE"] == "/run/secrets/api_key", name
        assert not any("PASSWORD=" in str(v) or "SECRET=" in str(v) for v in environment), name
    redis = services["redis"]
    assert sorted(redis["secrets"]) == sorted(
        ["redis_password", *(f"redis_{u[5:]}_password" for u in set(REDIS_USERS.values()))]
    )
    # The health check logs in (without the password on a command line).
    assert redis["healthcheck"]["test"][0] == "CMD-SHELL"
    assert "REDISCLI_AUTH=" in redis["healthcheck"]["test"][1]


def compose_acl_rules(document: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """The ACL rules of each role user in the redis service's script (after `on >PASSWORD`),
    with the script's shared `$rules` spelled out."""
    script = document["services"]["redis"]["command"][2]
    shared = re.search(r'^rules="([^"]*)"$', script, re.M)
    assert shared is not None, script
    rules = {}
    for user, rest in re.findall(r'echo "user (nori-\w+) on >\$\$\(cat \S+\) (.*)"$', script, re.M):
        rules[user] = tuple(rest.replace("$$rules", shared.group(1)).split())
    return rules


def test_compose_redis_users_have_the_rules_of_nori_up() -> None:
    from nori.launch.redis_acl import ROLE_COMMANDS, role_acl_rules

    expected = {
        user: (*rules, *ROLE_COMMANDS) for user, rules in role_acl_rules("nori", (7, 0)).items()
    }
    assert compose_acl_rules(_document()) == expected
    # The gateway's registry and directory patterns are read-only (redis:7 has %R~).
    assert "%R~nori:worker:*" in expected["nori-gateway"]
    assert _document()["services"]["redis"]["image"].startswith("redis:7")
