"""deploy/kubernetes renders (`kubectl kustomize`) into manifests that are valid under the
Kubernetes schemas (kubernetes-validate, strict; no cluster runs here) and hold what
compose.yaml holds: the same commands and health checks, secrets as files, the same Redis users.
KEDA's ScaledObject, whose schema is no part of Kubernetes, is checked field by field."""

from __future__ import annotations

import base64
import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.test_compose import REDIS_USERS, compose_acl_rules
from tests.deploy.test_compose import _document as compose_document

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
# The Kubernetes release whose schemas the manifests must satisfy.
KUBERNETES_VERSION = "1.32"
ROLES = ("gateway", "prefill", "decode", "batch")
WORKERS = ("prefill", "decode")
# The overlays, and "keda": the GPU overlay with the KEDA component, as README.md shows it.
OVERLAYS = ("cpu", "gpu", "keda")
KEDA_OVERLAY = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: nori
resources:
  - ../gpu
components:
  - ../../components/keda-autoscaling
"""

Document = dict[str, Any]


def secret_files() -> list[str]:
    """The files the Secret's generator reads (what deploy/make-secrets.sh must create)."""
    kustomization = yaml.safe_load((KUSTOMIZE / "secrets" / "kustomization.yaml").read_text())
    (generator,) = kustomization["secretGenerator"]
    return list(generator["files"])


def dummy_secret(name: str) -> str:
    return f"dummy-{name}-value"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Document]]:
    """Each overlay's documents, rendered from a copy of deploy/kubernetes whose secrets are
    dummies (a user's own secret files are left behind)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed (it renders the kustomizations)")
    tree = tmp_path_factory.mktemp("kubernetes") / "kubernetes"
    shutil.copytree(
        KUSTOMIZE,
        tree,
        ignore=lambda folder, names: (
            [n for n in names if n != "kustomization.yaml"]
            if Path(folder) == KUSTOMIZE / "secrets"
            else []
        ),
    )
    for name in secret_files():
        (tree / "secrets" / name).write_text(dummy_secret(name) + "\n")
    (tree / "overlays" / "keda").mkdir()
    (tree / "overlays" / "keda" / "kustomization.yaml").write_text(KEDA_OVERLAY)
    documents = {}
    for overlay in OVERLAYS:
        result = subprocess.run(
            ["kubectl", "kustomize", str(tree / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        documents[overlay] = [d for d in yaml.safe_load_all(result.stdout) if d]
    return documents


def of_kind(documents: list[Document], kind: str) -> dict[str, Document]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def generated(documents: list[Document], kind: str, name: str) -> Document:
    """A generated ConfigMap or Secret, by its name before kustomize's hash suffix."""
    (document,) = [
        d
        for d in documents
        if d["kind"] == kind and re.fullmatch(rf"{name}-[a-z0-9]{{10}}", d["metadata"]["name"])
    ]
    return document


def pod(deployment: Document) -> Document:
    return dict(deployment["spec"]["template"]["spec"])


def container(deployment: Document) -> Document:
    (only,) = pod(deployment)["containers"]
    return dict(only)


def environment(documents: list[Document], deployment: Document) -> dict[str, Any]:
    """The container's variables: its ConfigMaps' data, then its own entries (values, or the
    valueFrom of those taken from elsewhere)."""
    spec = container(deployment)
    variables: dict[str, Any] = {}
    for source in spec.get("envFrom", []):
        variables.update(of_kind(documents, "ConfigMap")[source["configMapRef"]["name"]]["data"])
    for entry in spec.get("env", []):
        variables[entry["name"]] = entry.get("value", entry.get("valueFrom"))
    return variables


def expand(text: str, variables: dict[str, Any]) -> str:
    """Kubernetes' expansion of a command: $(NAME) from the container's variables, $$ a `$`."""
    return re.sub(
        r"\$\$|\$\((\w+)\)",
        lambda m: "$" if m.group(0) == "$$" else str(variables.get(m.group(1), m.group(0))),
        text,
    )


def command(documents: list[Document], deployment: Document) -> list[str]:
    variables = environment(documents, deployment)
    return [expand(part, variables) for part in container(deployment)["args"]]


def compose_command(service: str) -> list[str]:
    command = compose_document()["services"][service]["command"]
    return [part.replace("${NORI_MODEL:-demo}", "demo") for part in command]


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def seconds(duration: str) -> int:
    """A Compose duration (2m, 75s, 1m30s) in seconds."""
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert match is not None and duration, duration
    return 60 * int(match.group(1) or 0) + int(match.group(2) or 0)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_document_is_valid_under_the_kubernetes_schemas(
    rendered: dict[str, list[Document]], overlay: str
) -> None:
    documents = rendered[overlay]
    for document in documents:
        if document["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD's: test_keda_scales_the_decode_deployment_on_its_own_load
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    # Kinds and names, generated ones without their hash suffix.
    kinds = {(d["kind"], re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"])) for d in documents}
    assert {("Deployment", name) for name in (*ROLES, "redis")} <= kinds
    assert {("Service", name) for name in (*ROLES, "redis")} <= kinds
    assert {("Secret", "nori-secrets"), ("ConfigMap", "nori-config")} <= kinds
    assert ("PersistentVolumeClaim", "batches") in kinds
    # All in one namespace, the one the manifests create.
    assert {d["metadata"].get("namespace") for d in documents if d["kind"] != "Namespace"} == {
        "nori"
    }
    assert set(of_kind(documents, "Namespace")) == {"nori"}


def test_strict_validation_rejects_a_misspelt_field_and_a_wrong_type(
    rendered: dict[str, list[Document]],
) -> None:
    gateway = of_kind(rendered["cpu"], "Deployment")["gateway"]
    misspelt = copy.deepcopy(gateway)
    misspelt["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    wrong = copy.deepcopy(gateway)
    wrong["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60s"
    with pytest.raises(kubernetes_validate.ValidationError, match="60s"):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)


def test_every_role_runs_the_compose_command_with_its_health_check_as_probes(
    rendered: dict[str, list[Document]],
) -> None:
    from nori.cli.main import build_parser

    documents = rendered["cpu"]
    services = compose_document()["services"]
    for role in ROLES:
        deployment = of_kind(documents, "Deployment")[role]
        spec = container(deployment)
        assert spec["image"] == "nori:latest", role
        assert "command" not in spec, role  # the image's entrypoint, `nori`
        args = command(documents, deployment)
        assert args == compose_command(role), role
        assert callable(build_parser().parse_args(args).handler), role
        health = services[role]["healthcheck"]["test"][1:]  # ["nori", "health", TARGET]
        assert callable(build_parser().parse_args(health[1:]).handler), role
        probes = ["readinessProbe", "livenessProbe"] + (["startupProbe"] if role != "batch" else [])
        for probe in probes:
            assert spec[probe]["exec"]["command"] == health, (role, probe)
        # Compose's start_period: as long to start before the liveness probe counts.
        if "start_period" in services[role]["healthcheck"]:
            startup = spec["startupProbe"]
            allowed = startup["periodSeconds"] * startup["failureThreshold"]
            assert allowed >= seconds(services[role]["healthcheck"]["start_period"]), role
        # The probe asks the port the command serves on (a batch runner: its metrics').
        port = re.search(r":(\d+)", health[2])
        assert port is not None, health
        served = option(args, "--port" if role != "batch" else "--metrics-port")
        assert port.group(1) == served, role


def test_the_gpu_overlay_puts_prefill_and_decode_on_one_gpu_each_and_nothing_else(
    rendered: dict[str, list[Document]],
) -> None:
    from nori.cli.main import build_parser

    gpu = rendered["gpu"]
    for name, deployment in of_kind(gpu, "Deployment").items():
        resources = container(deployment)["resources"]
        wanted = {"nvidia.com/gpu": "1"} if name in WORKERS else {}
        for bound in ("requests", "limits"):
            assert {k: v for k, v in resources[bound].items() if k.startswith("nvidia.com/")} == (
                wanted
            ), (name, bound)
        if name in WORKERS:
            args = command(gpu, deployment)
            assert args == compose_command(f"{name}-gpu"), name
            assert build_parser().parse_args(args).device == "cuda", name
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(rendered["cpu"])
    # Nothing else differs from the CPU overlay.
    for name, deployment in of_kind(rendered["cpu"], "Deployment").items():
        if name not in WORKERS:
            assert of_kind(gpu, "Deployment")[name] == deployment, name


def test_secrets_are_mounted_files_each_role_its_own_and_never_environment_values(
    rendered: dict[str, list[Document]],
) -> None:
    documents = rendered["cpu"]
    secret = generated(documents, "Secret", "nori-secrets")
    assert sorted(secret["data"]) == sorted(secret_files())
    for name, value in secret["data"].items():
        assert base64.b64decode(value).decode().strip() == dummy_secret(name)
    # No value outside the Secret, nor a variable taken from it.
    others = yaml.safe_dump_all([d for d in documents if d["kind"] != "Secret"])
    assert not any(dummy_secret(name) in others for name in secret_files())
    assert "secretKeyRef" not in others and "secretRef" not in others
    services = compose_document()["services"]
    for name in (*ROLES, "redis"):
        # The secrets compose.yaml gives the service: the API key to the gateway (which requires
        # it) and the batch runners (which send it), each role only its own Redis password.
        files = set(services[name]["secrets"])
        deployment = of_kind(documents, "Deployment")[name]
        (volume,) = [v for v in pod(deployment)["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"], name
        items = volume["secret"]["items"]
        assert {i["key"] for i in items} == files, name
        assert files <= set(secret["data"]), name
        assert all(i["key"] == i["path"] for i in items), name
        # Readable by the pod's group only (fsGroup), as the container's user runs in it.
        security = pod(deployment)["securityContext"]
        assert volume["secret"]["defaultMode"] == 0o440, name
        assert security["fsGroup"] == security["runAsGroup"], name
        (mount,) = [m for m in container(deployment)["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": "/run/secrets", "readOnly": True}
        if name == "redis":
            continue
        variables = environment(documents, deployment)
        files_named = {
            variable: value
            for variable, value in variables.items()
            if variable.endswith("_FILE") and isinstance(value, str)
        }
        wanted = {
            "NORI_CLUSTER_SECRET_FILE": "/run/secrets/cluster_secret",
            "NORI_REDIS_PASSWORD_FILE": f"/run/secrets/redis_{name}_password",
        }
        if "api_key" in files:
            wanted["NORI_API_KEY_FILE"] = "/run/secrets/api_key"
        assert files_named == wanted, name
        assert variables["REDIS_URL"] == f"redis://{REDIS_USERS[name]}@redis:6379/0", name


def test_pods_run_unprivileged_with_resources_drain_time_and_shared_memory(
    rendered: dict[str, list[Document]],
) -> None:
    from nori.cli.main import build_parser

    documents = rendered["cpu"]
    deployments = of_kind(documents, "Deployment")
    for name, deployment in deployments.items():
        spec, security = container(deployment), pod(deployment)["securityContext"]
        assert security["runAsNonRoot"] is True, name
        if name in ROLES:
            assert security["runAsUser"] == 10001, name  # the image's user `nori`
        assert spec["securityContext"]["allowPrivilegeEscalation"] is False, name
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(spec["resources"][bound]), (name, bound)
        for probe in ("readinessProbe", "livenessProbe"):
            assert spec[probe]["exec"]["command"], (name, probe)
    services = compose_document()["services"]
    for name, deployment in deployments.items():
        # compose.yaml's `init: true`: the pause process is PID 1, not the container's own.
        assert services[name]["init"] is True
        assert pod(deployment)["shareProcessNamespace"] is True, name
    for name in ROLES:
        # compose.yaml's stop_grace_period, which covers the role's drain.
        grace = pod(deployments[name])["terminationGracePeriodSeconds"]
        assert grace == seconds(services[name]["stop_grace_period"]), name
        args = build_parser().parse_args(command(documents, deployments[name]))
        assert getattr(args, "drain_timeout_s", 0) <= grace, name
    for name in WORKERS:
        deployment = deployments[name]
        # Its own pod IP in the registry, not the Service's name.
        assert environment(documents, deployment)["NORI_ADVERTISE_HOST"] == {
            "fieldRef": {"fieldPath": "status.podIP"}
        }
        (shm,) = [v for v in pod(deployment)["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}, name
        mounts = {m["mountPath"]: m["name"] for m in container(deployment)["volumeMounts"]}
        assert mounts["/dev/shm"] == "shm", name
    for name in ROLES:
        endpoint = environment(documents, deployments[name])["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        assert re.fullmatch(r"http://[\w.-]+:4317", endpoint), name


def test_the_gateway_and_the_batch_runners_share_the_batch_volume(
    rendered: dict[str, list[Document]],
) -> None:
    documents = rendered["cpu"]
    (claim,) = of_kind(documents, "PersistentVolumeClaim").values()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on several nodes
    for name in ("gateway", "batch"):
        deployment = of_kind(documents, "Deployment")[name]
        directory = option(command(documents, deployment), "--batch-dir")
        (mount,) = [m for m in container(deployment)["volumeMounts"] if m["mountPath"] == directory]
        (volume,) = [v for v in pod(deployment)["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], name


def test_services_select_their_role_and_reach_the_ports_it_serves(
    rendered: dict[str, list[Document]],
) -> None:
    documents = rendered["cpu"]
    services, deployments = of_kind(documents, "Service"), of_kind(documents, "Deployment")
    for name, service in services.items():
        deployment = deployments[name]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name
        assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"], name
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == ports, name
        if name in ROLES:
            # Every port the command opens is declared.
            args = command(documents, deployment)
            opened = {
                int(option(args, flag))
                for flag in ("--port", "--transfer-port", "--metrics-port")
                if flag in args
            }
            assert opened == set(ports.values()), name
    # The gateway's address for the cluster; the workers' Services only list their pods (each
    # registers its own pod IP), for Prometheus.
    assert services["gateway"]["spec"].get("clusterIP") != "None"
    assert services["gateway"]["spec"]["ports"][0]["port"] == 8000
    for name in (*WORKERS, "batch"):
        assert services[name]["spec"]["clusterIP"] == "None", name
    batch = command(documents, deployments["batch"])
    assert option(batch, "--gateway-url") == "http://gateway:8000"


def test_redis_writes_the_acl_file_of_compose_with_the_rules_of_nori_up(
    rendered: dict[str, list[Document]],
) -> None:
    from nori.launch.redis_acl import ROLE_COMMANDS, role_acl_rules

    redis = container(of_kind(rendered["cpu"], "Deployment")["redis"])
    compose_redis = compose_document()["services"]["redis"]
    assert redis["image"] == compose_redis["image"]
    # Kubernetes and Compose both read `$$` as `$`: the same text runs the same script.
    assert redis["command"] == compose_redis["command"]
    expected = {
        user: (*rules, *ROLE_COMMANDS) for user, rules in role_acl_rules("nori", (7, 0)).items()
    }
    assert compose_acl_rules({"services": {"redis": redis}}) == expected
    assert set(expected) == set(REDIS_USERS.values())
    for probe in ("readinessProbe", "livenessProbe"):
        check = redis[probe]["exec"]["command"]
        assert check[:2] == ["sh", "-c"] and "REDISCLI_AUTH=" in check[2], probe


def test_keda_scales_the_decode_deployment_on_its_own_load(
    rendered: dict[str, list[Document]],
) -> None:
    from nori.decode.servicer import DecodeWorker
    from nori.engine.outputs import EngineLoad
    from nori.worker.runtime import Worker
    from nori.worker.worker_metrics import WorkerMetrics

    documents = rendered["keda"]
    (scaled,) = [d for d in documents if d["apiVersion"].startswith("keda.sh/")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "idleReplicaCount",
        "advanced",
        "fallback",
        "triggers",
    }
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    decode = of_kind(documents, "Deployment")[target["name"]]
    assert container(decode)["args"][:2] == ["serve", "decode"]
    assert scaled["metadata"]["namespace"] == decode["metadata"]["namespace"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    # KEDA's own HPA takes its behavior: scaling down waits for workers to drain.
    scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    drain_s = pod(decode)["terminationGracePeriodSeconds"]
    assert [p["periodSeconds"] >= drain_s for p in scale_down["policies"]] == [True]

    # What a decode worker serves on /metrics: a Worker's WorkerMetrics with its engine's state.
    assert issubclass(DecodeWorker, Worker)
    metrics = WorkerMetrics()
    metrics.watch_engine(EngineLoad, lambda: 0)
    exported = {s.name for f in metrics.registry.collect() for s in f.samples}
    jobs = {
        job["job_name"]: job
        for job in yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())[
            "scrape_configs"
        ]
    }
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger.get("metricType", "AverageValue") == "AverageValue"  # per replica
    assert float(trigger["metadata"]["threshold"]) > 0
    assert trigger["metadata"]["serverAddress"].startswith("http")
    query = trigger["metadata"]["query"]
    used = set(re.findall(r"\bnori_\w+", query))
    assert used == {"nori_num_requests_running", "nori_num_requests_waiting"}
    assert used <= exported, sorted(used - exported)
    # Only the decode workers' series: the scrape job of deploy/prometheus.yml that finds them.
    selected = re.findall(r"\{([^}]*)\}", query)
    assert selected and all(s == 'job="nori-decode"' for s in selected), query
    assert "decode" in jobs["nori-decode"]["dns_sd_configs"][0]["names"]
    # The component adds only the ScaledObject.
    assert [d for d in documents if d is not scaled] == rendered["gpu"]


def test_make_secrets_creates_every_file_the_generator_reads_and_git_ignores_them(
    tmp_path: Path,
) -> None:
    subprocess.run(
        ["bash", str(ROOT / "deploy" / "make-secrets.sh"), str(tmp_path / "secrets")],
        check=True,
        capture_output=True,
        timeout=60,
    )
    made = {p.name for p in (tmp_path / "secrets").iterdir() if p.read_text().strip()}
    assert set(secret_files()) == made
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return
    for name, ignored in [(n, True) for n in secret_files()] + [("kustomization.yaml", False)]:
        path = f"deploy/kubernetes/secrets/{name}"
        status = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, timeout=30
        ).returncode
        assert status == (0 if ignored else 1), path
