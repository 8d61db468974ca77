"""`nori serve gateway|prefill|decode|batch`: run one role of a cluster (what a container runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from nori.cli.engine_args import (
    SERVING_BACKGROUND_PREFILL_BUDGET,
    SERVING_PREFILL_BUDGET,
    add_engine_args,
    add_engine_core_arg,
    engine_config_from_args,
    prefill_budget_by_role,
)
from nori.cli.gateway_args import add_gateway_args
from nori.settings import (
    DEFAULT_KV_LEASE_S,
    DEFAULT_NAMESPACE,
    DEFAULT_REDIS_URL,
    Environment,
    Role,
    settings_from,
)

if TYPE_CHECKING:
    from nori.worker.runtime import WorkerOptions


def served_model_name(model: str, override: str | None) -> str:
    """The model id of the API: --served-model-name, else the model folder's name."""
    from nori.models.demo import BUILTIN_MODELS

    if override:
        return override
    if model in BUILTIN_MODELS:
        return model
    return Path(model).expanduser().resolve().name


def _add_cluster_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--host", default="0.0.0.0", help="address to listen on")
    group.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    group.add_argument(
        "--advertise-host",
        default=Environment.read().advertise_host or "127.0.0.1",
        help="the host name other processes reach this one at (a container's service name)",
    )
    group.add_argument(
        "--redis-url",
        default=Environment.read().redis_url or DEFAULT_REDIS_URL,
        help="Redis for the worker registry, request states and the block directory "
        "(default: $REDIS_URL or %(default)s)",
    )
    group.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="prefix of every Redis key")
    group.add_argument(
        "--cluster-secret",
        default=None,
        metavar="SECRET",
        help="the secret every role of the cluster shares: workers sign their registry entries "
        "and require it on gRPC calls (default: $NORI_CLUSTER_SECRET, else the file "
        "$NORI_CLUSTER_SECRET_FILE; none: an open cluster, for one trusted host only)",
    )
    group.add_argument("--served-model-name", default=None)
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send traces to this OTLP/gRPC collector, e.g. http://jaeger:4317 (default: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; none: no tracing)",
    )
    cpus = parser.add_argument_group("CPUs")
    cpus.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="run only on these CPUs (taskset syntax: 0-3,6), set first thing in the process, "
        "before any thread starts (default: all this process may use)",
    )
    cpus.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads (torch, OpenMP, MKL); default with --cpus: one per CPU for a "
        "worker, 1 for the gateway; without: the libraries' default",
    )


def _bind(
    args: argparse.Namespace,
    role: Role,
    default_threads: int | None = None,
    uses_torch: bool = True,
) -> None:
    """Applies --cpus/--threads before anything else starts a thread (nori.worker.cpu_binding),
    then logs what it got. `uses_torch=False`: torch never loads, the count only goes in the env."""
    from nori.worker.cpu_binding import CpuBinding, bind_process, log_binding, set_torch_threads

    binding = CpuBinding.from_flags(args.cpus, args.threads, default_threads)
    bind_process(binding)
    log_binding(role, set_torch_threads(binding) if uses_torch else binding.threads)


def _add_worker_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    _add_cluster_args(parser, default_port)
    group = parser.add_argument_group("worker")
    group.add_argument("--worker-id", default="", help="default: ROLE-HOSTNAME-PID")
    group.add_argument(
        "--transport",
        default=None,
        choices=["ucx", "tcp"],
        help="how KV blocks move between hosts (default: ucx where ucxx imports, else tcp)",
    )
    group.add_argument("--drain-timeout-s", type=float, default=120.0)
    add_engine_core_arg(group)
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests held beyond the running batch (--max-num-seqs) before new ones are "
        "refused, which the gateway answers with 429 when every worker is full (default: a "
        "quarter of --max-num-seqs, at least 8)",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus /metrics on this port (0: a free one, logged and stated in the "
        "registry; -1: none)",
    )
    add_engine_args(
        parser,
        prefill_budget_with_decodes=SERVING_PREFILL_BUDGET,
        background_prefill_budget=SERVING_BACKGROUND_PREFILL_BUDGET,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run one role of a Nori cluster")
    roles = parser.add_subparsers(dest="role", required=True)

    gateway = roles.add_parser("gateway", help="the OpenAI-compatible HTTP endpoint")
    _add_cluster_args(gateway, default_port=8000)
    add_gateway_args(gateway)
    gateway.set_defaults(handler=run_gateway)

    batch = roles.add_parser(
        "batch", help="a batch runner: runs the lines of the batches in --batch-dir"
    )
    _add_cluster_args(batch, default_port=0)
    batch.add_argument(
        "--batch-dir", required=True, metavar="DIR", help="the gateway's --batch-dir"
    )
    batch.add_argument(
        "--gateway-url",
        default="http://127.0.0.1:8000",
        help="where the lines go: the gateway's routing, at the lowest priority",
    )
    batch.add_argument("--runner-id", default="", help="default: HOSTNAME-PID (unique per runner)")
    batch.add_argument(
        "--max-in-flight",
        type=int,
        default=512,
        help="lines sent at once (the gateway queues what its pools cannot start yet)",
    )
    batch.add_argument(
        "--lease-s",
        type=float,
        default=10.0,
        help="a line this runner stops renewing is taken over by another runner after this long",
    )
    batch.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus /metrics here; 0: none"
    )
    batch.set_defaults(handler=run_batch_runner)

    prefill = roles.add_parser("prefill", help="a prefill worker")
    _add_worker_args(prefill, default_port=50061)
    prefill.set_defaults(handler=run_prefill)

    decode = roles.add_parser("decode", help="a decode worker")
    _add_worker_args(decode, default_port=50071)
    decode.add_argument("--transfer-port", type=int, default=0, help="KV transfer listener port")
    decode.add_argument(
        "--kv-lease-s",
        type=float,
        default=DEFAULT_KV_LEASE_S,
        help="reserved blocks are freed when the prefill worker holding their prompt has not "
        "renewed them for this many seconds (it renews while the prompt is queued or computed)",
    )
    decode.add_argument(
        "--kv-queue-timeout-s",
        type=float,
        default=60.0,
        help="reserved blocks are also freed when their prompt has waited this long in the "
        "prefill queue without being started (gateway admission keeps queues much shorter)",
    )
    decode.add_argument(
        "--kv-transfer-timeout-s",
        type=float,
        default=30.0,
        help="blocks whose transfer has started are freed when it has not finished this long "
        "after it started (a sender that died or hung mid-transfer)",
    )
    decode.add_argument(
        "--colocated",
        action="store_true",
        help="compute prompts here too (one worker doing prefill and decode, no transfers)",
    )
    # Unset, the budget depends on --colocated (run_decode).
    decode.set_defaults(handler=run_decode)
    prefill_budget_by_role(decode)


def _worker_options(args: argparse.Namespace) -> WorkerOptions:
    from nori.worker.runtime import WorkerOptions

    return settings_from(
        WorkerOptions,
        args,
        served_model_name=served_model_name(args.model, args.served_model_name),
        cluster_secret=cluster_secret(args),
    )


def cluster_secret(args: argparse.Namespace) -> str | None:
    """--cluster-secret, else the environment's (read here, so --help never prints it)."""
    return args.cluster_secret or Environment.read().cluster_secret


def run_prefill(args: argparse.Namespace) -> int:
    # The engine options first: a bad one is the process's only line (no binding line above it).
    config = engine_config_from_args(args)
    _bind(args, "prefill")
    from nori.prefill.worker import PrefillWorker
    from nori.worker.runtime import run_worker

    run_worker(PrefillWorker(_worker_options(args), config, transport=args.transport))
    return 0


def run_decode(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)  # before the binding line, as run_prefill
    _bind(args, "colocated" if args.colocated else "decode")
    from nori.decode.servicer import DecodeWorker
    from nori.worker.runtime import run_worker

    if args.kv_lease_s <= 0:
        raise ValueError(f"--kv-lease-s must be positive, got {args.kv_lease_s}")
    if args.kv_queue_timeout_s <= 0:
        raise ValueError(f"--kv-queue-timeout-s must be positive, got {args.kv_queue_timeout_s}")
    if args.kv_transfer_timeout_s <= 0:
        raise ValueError(
            f"--kv-transfer-timeout-s must be positive, got {args.kv_transfer_timeout_s}"
        )
    worker = DecodeWorker(
        _worker_options(args),
        config,
        transport=args.transport,
        transfer_port=args.transfer_port,
        lease_s=args.kv_lease_s,
        colocated=args.colocated,
        queue_timeout_s=args.kv_queue_timeout_s,
        transfer_timeout_s=args.kv_transfer_timeout_s,
    )
    run_worker(worker)
    return 0


def run_batch_runner(args: argparse.Namespace) -> int:
    _bind(args, "batch", default_threads=1, uses_torch=False)
    import asyncio

    from nori.batch.runner import RunnerOptions, serve_batch
    from nori.telemetry.tracing import Tracing

    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be at least 1, got {args.max_in_flight}")
    if args.lease_s <= 0:
        raise ValueError(f"--lease-s must be positive, got {args.lease_s}")
    options = settings_from(
        RunnerOptions,
        args,
        metrics_host=args.host,
        api_key=Environment.read().api_key,
        cluster_secret=cluster_secret(args),
    )
    tracing = Tracing.for_role("batch", args.otlp_traces_endpoint)
    try:
        asyncio.run(serve_batch(options, tracing.tracer))
    finally:
        tracing.shutdown()
    return 0


def run_gateway(args: argparse.Namespace) -> int:
    # One thread by default: the gateway does no tensor math.
    _bind(args, "gateway", default_threads=1, uses_torch=False)
    import asyncio

    from nori.gateway.server import GatewayOptions, serve_gateway

    options = settings_from(
        GatewayOptions,
        args,
        served_model_name=served_model_name(args.model, args.served_model_name),
        # From the environment rather than a flag's default: --help must not print the key.
        api_key=args.api_key or Environment.read().api_key,
        cluster_secret=cluster_secret(args),
    )
    asyncio.run(serve_gateway(options))
    return 0
