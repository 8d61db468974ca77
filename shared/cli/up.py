"""`nori up`: a whole local cluster (Redis, gateway, prefill and decode workers) in one command."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import threading
import time
from typing import TYPE_CHECKING

from nori.cli.engine_args import (
    SERVING_BACKGROUND_PREFILL_BUDGET,
    SERVING_PREFILL_BUDGET,
    add_engine_args,
    positive_int,
    prefill_budget_by_role,
)
from nori.cli.up_phases import curl_line, prepare_model_and_kernels, say
from nori.launch.cpu_plan import PINNED_ROLES
from nori.settings import (
    DEFAULT_DISAGGREGATION,
    DEFAULT_KV_LEASE_S,
    DEFAULT_MAX_LOCAL_COMPUTE_S,
    DEFAULT_MODEL,
    DEFAULT_NAMESPACE,
    DISAGGREGATION_MODES,
    Environment,
    settings_from,
)

if TYPE_CHECKING:
    from pathlib import Path

    from nori.launch.cpu_plan import CpuPlan
    from nori.launch.local_cluster import ClusterSpec
    from nori.launch.redis_server import RedisServer


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="run a local cluster: gateway, prefill and decode workers as processes"
    )
    add_up_args(parser)
    parser.set_defaults(handler=run)


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (the same as --model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's address (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="one worker doing prefill and decode (the baseline for disaggregation)",
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the gateway's chat template (a file, or the template itself), for models with none",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="every process sends its spans to this OTLP/gRPC collector, e.g. "
        "http://127.0.0.1:4317 (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "$OTEL_EXPORTER_OTLP_ENDPOINT; none: no tracing)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="the key the gateway's API requires as `Authorization: Bearer KEY` "
        "(default: $NORI_API_KEY, else none)",
    )
    parser.add_argument("--kv-lease-s", type=float, default=DEFAULT_KV_LEASE_S)
    parser.add_argument("--kv-queue-timeout-s", type=float, default=60.0)
    add_cluster_args(parser)
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="prefix of every Redis key")
    parser.add_argument(
        "--batch-dir",
        default=None,
        metavar="DIR",
        help="the Batch API's files and batches (default: ~/.cache/nori/batches, or "
        "$NORI_CACHE_DIR/batches): kept across runs, so a batch survives a restart",
    )
    parser.add_argument(
        "--batch-runners",
        type=int,
        default=1,
        help="batch runner processes (`nori serve batch`); 0: no Batch API",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--log-dir", default=None, help="where each process writes its log")
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-args",
            default="",
            metavar="'ARGS'",
            help=f"engine options for the {role} workers only, after the others "
            "(e.g. --prefill-args '--tensor-parallel-size 2': each pool its own TP size)",
        )
    _add_cpu_args(parser)
    engine_actions = add_engine_args(
        parser,
        SERVING_PREFILL_BUDGET,
        background_prefill_budget=SERVING_BACKGROUND_PREFILL_BUDGET,
        with_model=False,
    )
    prefill_budget_by_role(parser)
    parser.set_defaults(engine_actions=engine_actions)


def add_cluster_args(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """What `nori up` and both sides of `nori bench compare` share."""
    group.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model folder, .gguf file or built-in name (demo and small: random weights, for "
        "tests)",
    )
    group.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    group.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    group.add_argument("--transport", choices=["ucx", "tcp"], help="default: ucx if ucxx imports")
    group.add_argument(
        "--disaggregation",
        choices=DISAGGREGATION_MODES,
        default=DEFAULT_DISAGGREGATION,
        help="where prompts are computed: always on a prefill worker, never (on the decode "
        "worker), or auto: per request, by measured costs (default %(default)s)",
    )
    group.add_argument(
        "--max-local-compute-s",
        type=float,
        default=DEFAULT_MAX_LOCAL_COMPUTE_S,
        help="with auto: the most compute a prompt may take on its decode worker "
        "(default %(default)s)",
    )
    group.add_argument(
        "--max-queued-prompt-tokens",
        type=int,
        default=8192,
        help="gateway admission bound per prefill (or colocated) worker; 0 = no bound",
    )
    group.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="the gateway's: streamed tokens per event (default %(default)s: each as it comes)",
    )
    group.add_argument(
        "--worker-args",
        default="",
        metavar="'ARGS'",
        help="engine options for every worker, as one string "
        "(e.g. '--no-prefix-caching --max-num-seqs 64'; see `nori serve decode --help`)",
    )


def _add_cpu_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "CPUs",
        "by default prefill and decode workers get disjoint CPUs (split in proportion to their "
        "numbers), a colocated worker all of them, the gateway the prefill CPUs; each worker "
        "runs one intra-op thread per CPU",
    )
    for role, what in (
        ("prefill", "the prefill workers' CPUs, shared out among them"),
        ("decode", "the decode workers' CPUs, shared out among them"),
        ("gateway", "the gateway's CPUs"),
    ):
        group.add_argument(f"--cpus-{role}", default=None, metavar="LIST", help=f"{what} (0-3,6)")
    for role in PINNED_ROLES:
        group.add_argument(
            f"--threads-{role}",
            type=int,
            default=None,
            metavar="N",
            help=f"intra-op threads of each {role} process (default: its number of CPUs"
            + (", 1 for the gateway)" if role == "gateway" else ")"),
        )
    group.add_argument(
        "--no-cpu-pinning",
        action="store_true",
        help="every process on every CPU with the libraries' default thread counts",
    )


def cpu_plan_from_args(args: argparse.Namespace) -> CpuPlan | None:
    """The plan for this machine and these flags; None with --no-cpu-pinning."""
    from nori.launch.cpu_plan import CpuRequest, plan_cpus

    if args.no_cpu_pinning:
        return None
    request = settings_from(CpuRequest, args, num_prefill=args.prefill, num_decode=args.decode)
    return plan_cpus(os.sched_getaffinity(0), request)


def prepare_cluster(args: argparse.Namespace) -> tuple[ClusterSpec, RedisServer | None]:
    """The cluster `nori up`'s flags describe and its private Redis (None when REDIS_URL names
    one); checks the flags and builds what every worker would (demo checkpoint, C++ kernels)."""
    from pathlib import Path

    from nori.cli.engine_args import changed_engine_flags, speculative_config_from_flag, worker_args
    from nori.cli.serve import served_model_name
    from nori.cluster_auth import generate_secret
    from nori.launch.local_cluster import ClusterSpec, check_port_free
    from nori.launch.redis_server import redis_for_cluster

    if args.model_tag is not None:
        if args.model not in (DEFAULT_MODEL, args.model_tag):
            raise ValueError(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.prefill < 1 or args.decode < 1:
        raise ValueError("--prefill and --decode must be at least 1")
    if args.batch_runners < 0:
        raise ValueError(f"--batch-runners must be at least 0, got {args.batch_runners}")
    speculative_config_from_flag(args.speculative_config)
    check_port_free(args.port, args.host)
    cpu_plan = cpu_plan_from_args(args)
    engine_flags = changed_engine_flags(args, args.engine_actions)
    extra_worker_args = worker_args(shlex.join(engine_flags) + " " + args.worker_args)
    prefill_args = worker_args(args.prefill_args, "--prefill-args")
    decode_args = worker_args(args.decode_args, "--decode-args")
    _check_pools_speculate_alike(args, extra_worker_args, prefill_args, decode_args)
    from nori.kernels.cpu_build import cpu_kernels

    # Before the pinned workers start: each would build the kernels on one CPU.
    build = cpu_kernels if Environment.read().cpu_kernels else None
    prepare_model_and_kernels(args.model, args.tokenizer, build)
    redis_url, redis_server = redis_for_cluster(args.namespace)
    role_redis_urls = redis_server.role_urls() if redis_server is not None else {}
    spec = settings_from(
        ClusterSpec,
        args,
        redis_url=redis_url,
        role_redis_urls=tuple(sorted(role_redis_urls.items())),
        num_prefill=args.prefill,
        num_decode=args.decode,
        served_model_name=served_model_name(args.model, args.served_model_name),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        cpu_plan=cpu_plan,
        worker_args=extra_worker_args,
        prefill_args=prefill_args,
        decode_args=decode_args,
        api_key=args.api_key or Environment.read().api_key,
        cluster_secret=Environment.read().cluster_secret or generate_secret(),
        batch_dir=default_batch_dir(args.batch_dir) if args.batch_runners else None,
        num_batch_runners=args.batch_runners,
    )
    return spec, redis_server


def _check_pools_speculate_alike(
    args: argparse.Namespace,
    shared: tuple[str, ...],
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
) -> None:
    """Refuses pools given different --speculative-config (the gateway pairs only equal ones)."""
    from nori.cli.engine_args import speculative_config_of

    if args.colocated:
        return  # one pool
    settings = {
        pool: speculative_config_of((*shared, *own))
        for pool, own in (("prefill", prefill), ("decode", decode))
    }
    if settings["prefill"] != settings["decode"]:
        described = {
            pool: config.as_json() if config is not None else "off"
            for pool, config in settings.items()
        }
        raise ValueError(
            f"the prefill workers' --speculative-config ({described['prefill']}) differs from "
            f"the decode workers' ({described['decode']}); the gateway pairs only workers "
            "that agree"
        )


def run(args: argparse.Namespace) -> int:
    from nori.launch.local_cluster import LocalCluster
    from nori.models.demo import resolve_model
    from nori.state.connection import redacted

    started = time.monotonic()
    spec, redis_server = prepare_cluster(args)
    redis_url = spec.redis_url
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    cluster = LocalCluster(spec)
    try:
        where = "private redis-server" if redis_server is not None else "REDIS_URL"
        print(
            f"nori: Redis at {redacted(redis_url)} ({where}); starting the cluster...", flush=True
        )
        print(_describe_plan(spec.cpu_plan), flush=True)
        roles_started = time.monotonic()
        cluster.start(
            timeout_s=args.startup_timeout_s,
            on_healthy=lambda role: say(
                f"{role} healthy ({time.monotonic() - roles_started:.1f} s after starting)"
            ),
        )
        name = spec.served_model_name or spec.model
        pools = "colocated" if args.colocated else f"{args.prefill} prefill, {args.decode} decode"
        # A key from --api-key is on the command line already; one from the environment is not.
        bearer = None if spec.api_key is None else (args.api_key or "$NORI_API_KEY")
        curl = curl_line(cluster.url, name, resolve_model(spec.model), bearer)
        say(
            f"serving {name!r} at {cluster.url}/v1 ({pools}), "
            f"{time.monotonic() - started:.1f} s after `nori up` began\n  {curl}"
            f"\n  logs: {cluster.processes[0].log_path.parent}; Ctrl-C stops everything"
        )
        redis_supervisor = RedisSupervisor(redis_server) if redis_server is not None else None
        while not stop.wait(0.5):
            events = redis_supervisor.check() if redis_supervisor is not None else []
            for event in [*events, *cluster.supervise()]:
                print(f"nori: {event}", flush=True)
    except RuntimeError as error:
        print(f"nori: error: {error}", flush=True)
        return 1
    finally:
        print("nori: stopping the cluster...", flush=True)
        cluster.stop()
        if redis_server is not None:
            redis_server.stop()
    print("nori: stopped", flush=True)
    return 0


def default_batch_dir(flag: str | None) -> Path:
    """--batch-dir, else batches/ beside the built-in models' cache."""
    from pathlib import Path

    if flag:
        return Path(flag).expanduser()
    cache = Environment.read().cache_dir
    return (cache / "batches") if cache else Path.home() / ".cache" / "nori" / "batches"


class RedisSupervisor:
    """Starts `nori up`'s private Redis again when it dies (same port and credentials, empty);
    the workers re-register once it answers. A failed restart is retried at every check.
    """

    def __init__(self, server: RedisServer) -> None:
        self._server = server
        self._failing = False

    def check(self) -> list[str]:
        """Restarts the server if it died; what happened, one line each."""
        from nori.launch.redis_server import RedisUnavailable

        if self._server.running:
            return []
        code = self._server.returncode
        try:
            self._server.restart()
        except RedisUnavailable as error:
            if self._failing:
                return []
            self._failing = True
            return [f"redis-server exited (status {code}); restarting it failed, retrying: {error}"]
        status = "" if self._failing else f" (status {code})"
        self._failing = False
        return [f"redis-server exited{status}; restarted on port {self._server.port}"]


def _describe_plan(plan: CpuPlan | None) -> str:
    if plan is None:
        return "nori: CPUs: not pinned (--no-cpu-pinning)"
    from nori.launch.cpu_plan import format_cpu_list

    header = f"nori: CPUs {format_cpu_list(plan.usable)}, per process:"
    return "\n".join([header, *(f"  {line}" for line in plan.describe())])
