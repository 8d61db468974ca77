"""`nori bench ...`: the project's benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nori.bench.serve.args import add_serve_args, settings_from_args
from nori.cli.engine_args import add_engine_args, engine_config_from_args


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
    offline.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(offline)
    offline.set_defaults(handler=run_offline)

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


def run_offline(args: argparse.Namespace) -> int:
    from nori.bench.offline import parse_range, run_offline_benchmark

    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    report = run_offline_benchmark(
        engine_config_from_args(args),
        num_prompts=args.num_prompts,
        input_range=parse_range(args.input_len_range),
        output_range=parse_range(args.output_len_range),
        compare_static=args.compare_static,
        show_progress=sys.stderr.isatty() or not args.json,
        repeats=args.repeats,
    )
    _print_report(report, args.json)
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


def _print_report(report: dict[str, object], as_json: bool) -> None:
    """One JSON object, or one aligned `key: value` line per figure."""
    if as_json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>28}: {value}")
