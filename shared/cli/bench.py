"""`nori bench ...`: the project's benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nori.bench.serve.args import (
    add_serve_args,
    add_workload_args,
    settings_from_args,
    workload_settings_from_args,
)
from nori.cli.engine_args import add_engine_args, engine_config_from_args, worker_args
from nori.cli.progress import add_progress_arg, show_progress
from nori.launch.up import add_cluster_args

if TYPE_CHECKING:
    from nori.bench.cluster_probe import BenchCluster
    from nori.bench.compare import CompareOutcome, CompareSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks")
    commands = parser.add_subparsers(dest="bench_command", required=True)
    offline = commands.add_parser("offline", help="offline generation throughput")
    offline.add_argument("--num-prompts", type=int, default=128)
    offline.add_argument("--input-len-range", default="32:512", metavar="A:B")
    offline.add_argument("--output-len-range", default="16:512", metavar="C:D")
    offline.add_argument(
        "--compare-static",
        action="store_true",
        help="also run static batching on the same prompts and report the ratio",
    )
    offline.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per policy, taking turns; the median run is reported",
    )
    offline.add_argument(
        "--batch-file",
        default=None,
        metavar="FILE",
        help="the requests of this batch file (`nori bench batch-file`: token-id prompts, "
        "greedy, ignore_eos) instead of random ones: the same work `nori run-batch` does",
    )
    offline.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_arg(offline)
    add_engine_args(offline)
    offline.set_defaults(handler=run_offline)

    batch_file = commands.add_parser(
        "batch-file",
        help="ShareGPT conversations as an OpenAI batch file (for `nori run-batch` and "
        "`nori bench offline --batch-file`)",
    )
    batch_file.add_argument("--dataset-path", required=True, help="a ShareGPT JSON file")
    batch_file.add_argument("-o", "--output-file", required=True)
    batch_file.add_argument("--num-prompts", type=int, default=1000)
    batch_file.add_argument(
        "--max-tokens-cap", type=int, default=256, help="max_tokens: the answer's length, capped"
    )
    batch_file.add_argument("--model", default="demo", help="whose tokenizer encodes the prompts")
    batch_file.add_argument("--served-model-name", default=None)
    batch_file.add_argument("--seed", type=int, default=0)
    batch_file.set_defaults(handler=run_batch_file)

    transfer = commands.add_parser(
        "transfer", help="KV block transfer bandwidth: UCX vs our TCP, a plain socket, memcpy"
    )
    transfer.add_argument("--total-mib", type=int, default=64, help="bytes moved per repeat")
    transfer.add_argument(
        "--block-kib",
        type=int,
        default=32,
        help="size of one block message (default: one layer's K or V of one 16-token block of "
        "a Llama-3-8B-class model in bfloat16)",
    )
    transfer.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    transfer.add_argument(
        "--transports",
        default="ucx,tcp_transport,socket,memcpy",
        help="comma-separated subset of ucx,tcp_transport,socket,memcpy",
    )
    transfer.add_argument("--json", action="store_true", help="print one JSON object")
    transfer.set_defaults(handler=run_transfer)

    serve = commands.add_parser(
        "serve", help="load an OpenAI-compatible server (ours or another) and measure it"
    )
    add_serve_args(serve)
    serve.set_defaults(handler=run_serve)
    fidelity = commands.add_parser(
        "fidelity",
        help="greedy agreement and logits cosine of a quantized model against its float32 self",
    )
    fidelity.add_argument("--model", default="demo", help="a checkpoint folder, or demo/small")
    fidelity.add_argument("--quantization", choices=["int8", "fp8"], default=None)
    fidelity.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    fidelity.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8", "fp8"],
        default="auto",
        help="the compared side's KV cache (auto: in --dtype)",
    )
    fidelity.add_argument("--num-prompts", type=int, default=16)
    fidelity.add_argument("--prompt-len", type=int, default=64)
    fidelity.add_argument("--output-len", type=int, default=64)
    fidelity.add_argument("--json", action="store_true", help="print one JSON object")
    fidelity.set_defaults(handler=run_fidelity)
    roofline = commands.add_parser(
        "roofline",
        help="this host's memory bandwidth and GEMM peaks, and the engine's decode and prefill "
        "steps against the floors they set",
    )
    roofline.add_argument(
        "--batch-sizes", default="1,16,64", metavar="B1,B2,...", help="decode rows per step"
    )
    roofline.add_argument(
        "--context", type=int, default=192, help="tokens in each decode row's KV (its prompt)"
    )
    roofline.add_argument("--prompt-len", type=int, default=512, help="the timed prefill's prompt")
    roofline.add_argument("--steps", type=int, default=16, help="timed decode steps per batch")
    roofline.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(roofline)
    roofline.set_defaults(handler=run_roofline)
    _register_compare(commands)


def _register_compare(commands: argparse._SubParsersAction) -> None:
    soak = commands.add_parser(
        "soak",
        help="sustained serving load on one cluster: throughput, every role's RSS and KV blocks "
        "over time; JSON and a PNG",
    )
    soak.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    soak.add_argument("--window-s", type=float, default=30.0, help="seconds between samples")
    soak.add_argument("--model", default="demo", help="model folder, or demo, small")
    soak.add_argument("--prefill", type=int, default=1, help="prefill workers")
    soak.add_argument("--decode", type=int, default=1, help="decode workers")
    soak.add_argument("--max-concurrency", type=int, default=16)
    soak.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    soak.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    soak.add_argument("--worker-args", default="", metavar="'ARGS'", help="engine options")
    soak.add_argument("--out-dir", default=".", help="where soak.json and soak.png go")
    soak.add_argument("--json", action="store_true", help="also print the report as JSON")
    soak.set_defaults(handler=run_soak)

    overload = commands.add_parser(
        "overload",
        help="offer a local cluster --factor times its capacity; judge 429s, TTFT, RSS, blocks",
    )
    overload.add_argument("--factor", type=float, default=5.0, help="times the capacity")
    overload.add_argument("--seconds", type=float, default=60.0, help="how long the overload runs")
    overload.add_argument(
        "--calibrate-s", type=float, default=20.0, help="closed-loop run that measures capacity"
    )
    overload.add_argument("--calibrate-concurrency", type=int, default=16)
    overload.add_argument(
        "--max-ttft-p99-s", type=float, default=10.0, help="the bound for admitted requests"
    )
    overload.add_argument("--model", default="demo", help="model folder, or demo, small")
    overload.add_argument("--prefill", type=int, default=1, help="prefill workers")
    overload.add_argument("--decode", type=int, default=1, help="decode workers")
    overload.add_argument("--colocated", action="store_true", help="one colocated worker")
    overload.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    overload.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    overload.add_argument("--worker-args", default="", metavar="'ARGS'", help="engine options")
    overload.add_argument("--out-dir", default=".", help="where overload.json goes")
    overload.add_argument("--json", action="store_true", help="also print the report as JSON")
    overload.set_defaults(handler=run_overload)

    compare = commands.add_parser(
        "compare",
        help="the same bench serve workload on `nori up --colocated` and on `nori up`, in turn, "
        "on the same CPUs",
    )
    cluster = compare.add_argument_group("clusters")
    add_cluster_args(cluster)
    cluster.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="the CPUs both sides run on (taskset syntax; default: all this process may use)",
    )
    cluster.add_argument("--startup-timeout-s", type=float, default=300.0)
    cluster.add_argument("--log-dir", default=None, help="where each process writes its log")
    add_workload_args(compare)
    runs = compare.add_argument_group("comparison")
    runs.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per side, alternating (c, d, c, d, ...); each side's median run by output "
        "throughput is reported",
    )
    runs.add_argument(
        "--sweep",
        default=None,
        metavar="R1,R2,...",
        help="compare at each of these request rates (req/s) instead of --request-rate",
    )
    runs.add_argument("--json", action="store_true", help="print one JSON object")
    runs.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="both median runs side by side; with --sweep, effective throughput and p99 ITL "
        "against the request rate",
    )
    # The workload that shows what disaggregation is for; warm-ups before every timed run.
    compare.set_defaults(handler=run_compare, dataset="mixed", num_warmups=2)


def run_offline(args: argparse.Namespace) -> int:
    from nori.bench.offline import parse_range, run_offline_benchmark

    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    workload = None
    if args.batch_file is not None:
        from pathlib import Path

        from nori.bench.batch_file import workload_from_batch_file

        workload = workload_from_batch_file(Path(args.batch_file))
    report = run_offline_benchmark(
        engine_config_from_args(args),
        num_prompts=args.num_prompts,
        input_range=parse_range(args.input_len_range),
        output_range=parse_range(args.output_len_range),
        compare_static=args.compare_static,
        show_progress=show_progress(args),
        repeats=args.repeats,
        workload=workload,
    )
    _print_report(report, args.json)
    return 0


def run_roofline(args: argparse.Namespace) -> int:
    import json

    from nori.bench.roofline import format_report, run_roofline

    try:
        batch_sizes = [int(part) for part in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(
            f"--batch-sizes takes integers like 1,16,64, got {args.batch_sizes!r}"
        ) from None
    if min(batch_sizes) < 1 or min(args.context, args.prompt_len, args.steps) < 1:
        raise ValueError("--batch-sizes, --context, --prompt-len and --steps must be >= 1")
    report = run_roofline(
        engine_config_from_args(args), batch_sizes, args.context, args.prompt_len, args.steps
    )
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def run_batch_file(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nori.bench.batch_file import write_sharegpt_batch_file
    from nori.cli.serve import served_model_name

    count = write_sharegpt_batch_file(
        Path(args.dataset_path),
        Path(args.output_file),
        args.model,
        served_model_name(args.model, args.served_model_name),
        args.num_prompts,
        args.max_tokens_cap,
        args.seed,
    )
    print(f"nori: {count} requests in {args.output_file}")
    return 0


def run_fidelity(args: argparse.Namespace) -> int:
    from nori.bench.fidelity import FidelitySettings, measure_fidelity
    from nori.models.demo import resolve_model

    if min(args.num_prompts, args.prompt_len, args.output_len) < 1:
        raise ValueError("--num-prompts, --prompt-len and --output-len must be >= 1")
    settings = FidelitySettings(
        model=str(resolve_model(args.model)),
        quantization=args.quantization,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        num_prompts=args.num_prompts,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
    )
    _print_report(measure_fidelity(settings).as_dict(), args.json)
    return 0


def run_transfer(args: argparse.Namespace) -> int:
    from nori.bench.transfer import TransferBenchConfig, run_transfer_benchmark

    settings = TransferBenchConfig(
        total_mib=args.total_mib,
        block_kib=args.block_kib,
        repeats=args.repeats,
        transports=tuple(name.strip() for name in args.transports.split(",") if name.strip()),
    )
    report = run_transfer_benchmark(settings)
    _print_report(report, args.json)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from nori.bench.serve.report import format_report
    from nori.bench.serve.runner import run_benchmark_sync

    settings = settings_from_args(args)
    result = run_benchmark_sync(settings, show_progress=sys.stderr.isatty() or not args.json)
    report = result.to_dict(detailed=args.save_detailed)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        from nori.bench.serve.plot import plot_runs

        plot_runs({result.model: result}, args.plot)
    if args.json:
        _print_report(report, as_json=True)
    else:
        print(format_report(result))
    return 0


def compare_settings_from_args(args: argparse.Namespace) -> CompareSettings:
    from nori.bench.compare import CompareSettings, parse_rates

    rates = parse_rates(args.sweep) if args.sweep is not None else ()
    if rates:
        # The sweep sets the rate of every run; the workload is checked at the first one (a
        # --duration needs a finite rate).
        args = argparse.Namespace(**{**vars(args), "request_rate": rates[0]})
    return CompareSettings(
        workload=workload_settings_from_args(args),
        model=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        worker_args=worker_args(args.worker_args),
        transport=args.transport,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        cpus=args.cpus,
        repeats=args.repeats,
        request_rates=rates,
        startup_timeout_s=args.startup_timeout_s,
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )


def _bench_cluster(args: argparse.Namespace, name: str, out: Path) -> BenchCluster:
    """The cluster options `soak` and `overload` share, from their flags."""
    from nori.bench.cluster_probe import BenchCluster

    return BenchCluster(
        model=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        colocated=getattr(args, "colocated", False),
        worker_args=worker_args(args.worker_args),
        log_dir=out / "logs",
        name=name,
    )


def _run_cluster_bench(
    run: Callable[[Callable[[str], None]], dict[str, Any]], out: Path, name: str
) -> dict[str, Any] | None:
    """Runs a benchmark that starts its own cluster and writes OUT/NAME.json; None on failure
    (said on stderr). SIGTERM unwinds like Ctrl-C, so the cluster is stopped on the way out."""
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        report = run(lambda line: print(f"nori: {line}", file=sys.stderr, flush=True))
    except (RuntimeError, TimeoutError) as error:
        print(f"nori: error: {error}", file=sys.stderr)
        return None
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def run_soak(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from nori.bench.soak import SoakSettings, plot_soak, run_soak

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    defaults = SoakSettings()
    settings = SoakSettings(
        minutes=args.minutes,
        window_s=args.window_s,
        cluster=_bench_cluster(args, "soak", out),
        workload=replace(
            defaults.workload,
            max_concurrency=args.max_concurrency,
            random_input_len=args.input_len,
            random_output_len=args.output_len,
        ),
    )
    report = _run_cluster_bench(lambda log: run_soak(settings, log), out, "soak")
    if report is None:
        return 1
    plot_soak(report, str(out / "soak.png"))
    summary = {key: value for key, value in report.items() if key != "windows"}
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def run_overload(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from nori.bench.overload import OverloadSettings, run_overload

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    defaults = OverloadSettings()
    settings = OverloadSettings(
        factor=args.factor,
        seconds=args.seconds,
        calibrate_s=args.calibrate_s,
        calibrate_concurrency=args.calibrate_concurrency,
        max_ttft_p99_s=args.max_ttft_p99_s,
        cluster=_bench_cluster(args, "overload", out),
        workload=replace(
            defaults.workload, random_input_len=args.input_len, random_output_len=args.output_len
        ),
    )
    report = _run_cluster_bench(lambda log: run_overload(settings, log), out, "overload")
    if report is None:
        return 1
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0 if all(report["ok"].values()) else 2


def run_compare(args: argparse.Namespace) -> int:
    import signal

    from nori.bench.compare import run_compare as compare

    settings = compare_settings_from_args(args)
    # SIGTERM unwinds like Ctrl-C, so that both clusters are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        outcome = compare(
            settings, lambda line: print(f"nori: {line}", file=sys.stderr, flush=True)
        )
    except (RuntimeError, TimeoutError) as error:
        print(f"nori: error: {error}", file=sys.stderr)
        return 1
    _report_compare(outcome, args)
    return 0


def _report_compare(outcome: CompareOutcome, args: argparse.Namespace) -> None:
    from nori.bench.compare_report import format_comparison, format_sweep

    report = outcome.report()
    if args.plot and outcome.sweep:
        from nori.bench.compare_plot import plot_sweep

        plot_sweep(outcome.point_reports(), args.plot)
    elif args.plot:
        from nori.bench.compare_report import SHORT_CLASS
        from nori.bench.serve.plot import plot_runs

        # The mixed dataset's short requests: the streams whose latency is compared.
        short = SHORT_CLASS if args.dataset == "mixed" else None
        plot_runs(outcome.points[0].median_runs(), args.plot, request_class=short)
    if args.json:
        print(json.dumps(report))
    elif outcome.sweep:
        print(format_sweep(outcome.point_reports()))
    else:
        print(format_comparison(report))


def _print_report(report: dict[str, object], as_json: bool) -> None:
    """One JSON object, or one aligned `key: value` line per figure."""
    if as_json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>28}: {value}")
