"""`nori bench soak|overload|compare`: the benchmarks that start local clusters of their own
(nori.bench.cluster_probe, nori.bench.compare) and judge them under load."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nori.bench.serve.args import add_workload_args, workload_settings_from_args
from nori.cli.engine_args import worker_args
from nori.cli.up import add_cluster_args

if TYPE_CHECKING:
    from nori.bench.cluster_probe import BenchCluster
    from nori.bench.compare import CompareOutcome, CompareSettings


def register_cluster_benchmarks(commands: argparse._SubParsersAction) -> None:
    """Adds soak, overload and compare to `nori bench`'s subcommands."""
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
        help="the same bench serve workload on `nori up --colocated`, `nori up` and `nori up "
        "--disaggregation auto`, in turn, on the same CPUs",
    )
    cluster = compare.add_argument_group("clusters")
    add_cluster_args(cluster)
    cluster.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="the CPUs every side runs on (taskset syntax; default: all this process may use)",
    )
    cluster.add_argument("--startup-timeout-s", type=float, default=300.0)
    cluster.add_argument("--log-dir", default=None, help="where each process writes its log")
    add_workload_args(compare)
    runs = compare.add_argument_group("comparison")
    runs.add_argument(
        "--sides",
        default="colocated,disaggregated,conditional",
        metavar="SIDE,SIDE[,SIDE]",
        help="two or three of: colocated (nori up --colocated), disaggregated (nori up: every "
        "prompt on a prefill worker), conditional (the same workers, --disaggregation auto) "
        "(default: all three)",
    )
    runs.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per side, alternating (c, d, a, c, d, a, ...); each side's median run by "
        "output throughput is reported",
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
        help="the median runs side by side; with --sweep, effective throughput and p99 ITL "
        "against the request rate, a line per side",
    )
    # No --disaggregation default: each side sets its own, and a given one is refused.
    compare.set_defaults(handler=run_compare, dataset="mixed", num_warmups=2, disaggregation=None)


def compare_settings_from_args(args: argparse.Namespace) -> CompareSettings:
    from nori.bench.compare import CompareSettings, parse_rates
    from nori.bench.compare_report import parse_sides

    if args.disaggregation is not None:
        raise ValueError(
            "--disaggregation: bench compare sets it per side (disaggregated: always, "
            "conditional: auto); choose the sides with --sides"
        )
    sides = parse_sides(args.sides)
    rates = parse_rates(args.sweep) if args.sweep is not None else ()
    if rates:
        # The sweep sets each run's rate; the workload is checked at the first (for --duration).
        args = argparse.Namespace(**{**vars(args), "request_rate": rates[0]})
    return CompareSettings(
        workload=workload_settings_from_args(args),
        model=args.model,
        sides=sides,
        num_prefill=args.prefill,
        num_decode=args.decode,
        worker_args=worker_args(args.worker_args),
        transport=args.transport,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        max_local_compute_s=args.max_local_compute_s,
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
    # SIGTERM unwinds like Ctrl-C, so that every cluster is stopped on the way out.
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
