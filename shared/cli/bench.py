"""`nori bench ...`: the project's benchmarks. Those that start local clusters of their own
(soak, overload, compare) are in nori.cli.cluster_bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nori.bench.serve.args import (
    add_serve_args,
    settings_from_args,
)
from nori.cli.bench_transfer import print_report, register_transfer
from nori.cli.cluster_bench import register_cluster_benchmarks
from nori.cli.engine_args import add_engine_args, engine_config_from_args
from nori.cli.progress import add_progress_arg, show_progress


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

    register_transfer(commands)

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
    overhead = commands.add_parser(
        "step-overhead",
        help="the engine's host milliseconds per decode step outside the model's forward "
        "(schedule, step inputs and sampling, update and outputs), by batch size",
    )
    overhead.add_argument(
        "--model", default=None, help="a model folder or built-in name (default: the tiny preset)"
    )
    overhead.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    overhead.add_argument(
        "--load-format", choices=["auto", "dummy"], default="auto", help="dummy: random weights"
    )
    overhead.add_argument("--batch-sizes", default="64,256", metavar="B1,B2,...")
    overhead.add_argument(
        "--enforce-eager", action="store_true", help="on CUDA, no decode CUDA graphs"
    )
    overhead.add_argument("--prompt-len", type=int, default=32)
    overhead.add_argument("--steps", type=int, default=50, help="timed decode steps per window")
    overhead.add_argument("--repeats", type=int, default=3, help="windows; the median is shown")
    overhead.add_argument("--json", action="store_true", help="print one JSON object")
    overhead.set_defaults(handler=run_step_overhead)
    spec = commands.add_parser(
        "spec-decode",
        help="decode tokens/s with and without speculative decoding (--speculative-config; "
        "default n-gram), by batch size, on the copy or ShareGPT prompts",
    )
    spec.add_argument("--dataset", choices=("copy", "sharegpt"), default="copy")
    spec.add_argument(
        "--dataset-path",
        default=None,
        help="a ShareGPT JSON file (default: ../shared/data/sharegpt/ShareGPT_V3_sample2000.json "
        "beside the checkout, when there)",
    )
    spec.add_argument("--batch-sizes", default="1,4,64", metavar="B1,B2,...")
    spec.add_argument(
        "--batches-per-size", type=int, default=2, help="requests per batch size, in batches"
    )
    spec.add_argument("--max-tokens", type=int, default=128)
    spec.add_argument("--max-prompt-len", type=int, default=768)
    spec.add_argument("--rounds", type=int, default=3, help="alternating timed runs per side")
    spec.add_argument("--json", action="store_true", help="print one JSON object")
    spec.add_argument("-o", "--output-file", default=None, help="also write the JSON here")
    add_engine_args(spec)
    spec.set_defaults(handler=run_spec_decode)
    moe_decode = commands.add_parser(
        "moe-decode",
        help="decode tokens/s of a mixture-of-experts model beside a dense one with the same "
        "active parameters (default small-moe vs small), by batch size",
    )
    moe_decode.add_argument("--dense-model", default="small")
    moe_decode.add_argument("--moe-model", default="small-moe")
    moe_decode.add_argument("--batch-sizes", default="16", metavar="B1,B2,...")
    moe_decode.add_argument(
        "--context", type=int, default=128, help="tokens in each decode row's KV (its prompt)"
    )
    moe_decode.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    moe_decode.add_argument("--rounds", type=int, default=3, help="alternating runs per side")
    moe_decode.add_argument("--json", action="store_true", help="print one JSON object")
    moe_decode.add_argument("-o", "--output-file", default=None, help="also write the JSON here")
    add_engine_args(moe_decode, with_model=False)
    moe_decode.set_defaults(handler=run_moe_decode)
    moe = commands.add_parser(
        "moe-layer",
        help="one mixture-of-experts layer on CPU: the PyTorch reference loop against the C++ "
        "fused kernel, by batch size",
    )
    moe.add_argument("--batch-sizes", default="1,16,64", metavar="B1,B2,...")
    moe.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    moe.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per side")
    moe.add_argument("--iterations", type=int, default=20, help="timed calls per round")
    moe.add_argument(
        "--weight-order",
        choices=("each-best", "panels", "in-out", "out-in"),
        default="each-best",
        help="each-best (= panels): the reference on PyTorch's [out, in] rows (as transformers "
        "stores them), the C++ kernel on the panels of 16 outputs the model stores on CPU; "
        "in-out/out-in: both paths on the same order",
    )
    moe.add_argument("--threads", type=int, default=None, help="torch threads for the run")
    moe.add_argument("--json", action="store_true", help="print one JSON object")
    moe.set_defaults(handler=run_moe_layer)
    register_cluster_benchmarks(commands)


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
    print_report(report, args.json)
    return 0


def run_spec_decode(args: argparse.Namespace) -> int:
    from nori.bench.spec_decode import (
        SpecBenchSettings,
        format_report,
        run_spec_decode_benchmark,
    )

    path = args.dataset_path
    if path is None:
        default = (
            Path(__file__).resolve().parents[2].parent
            / "shared/data/sharegpt/ShareGPT_V3_sample2000.json"
        )
        if not default.exists():
            raise ValueError("--dataset-path is needed: no ShareGPT file beside the checkout")
        path = str(default)
    sizes = tuple(int(size) for size in args.batch_sizes.split(","))
    if min(sizes) < 1 or args.rounds < 1 or args.max_tokens < 2:
        raise ValueError("--batch-sizes, --rounds must be >= 1 and --max-tokens >= 2")
    settings = SpecBenchSettings(
        dataset=args.dataset,
        dataset_path=Path(path),
        batch_sizes=sizes,
        batches_per_size=args.batches_per_size,
        max_tokens=args.max_tokens,
        max_prompt_len=args.max_prompt_len,
        rounds=args.rounds,
    )
    report = run_spec_decode_benchmark(engine_config_from_args(args), settings, not args.json)
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def run_moe_layer(args: argparse.Namespace) -> int:
    from nori.bench.moe_layer import (
        MoeLayerBenchSettings,
        dtypes_from_arg,
        parse_batch_sizes,
        run_moe_layer_benchmark,
    )

    settings = MoeLayerBenchSettings(
        batch_sizes=parse_batch_sizes(args.batch_sizes),
        dtypes=dtypes_from_arg(args.dtype),
        rounds=args.rounds,
        iterations=args.iterations,
        weight_order=args.weight_order,
        threads=args.threads,
    )
    report = run_moe_layer_benchmark(settings, show=not args.json)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _batch_sizes(text: str, example: str) -> list[int]:
    """`--batch-sizes` as integers; a ValueError (the CLI's one-line error) naming the flag."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes takes integers like {example}, got {text!r}") from None


def run_roofline(args: argparse.Namespace) -> int:
    import json

    from nori.bench.roofline import format_report, run_roofline

    batch_sizes = _batch_sizes(args.batch_sizes, "1,16,64")
    if min(batch_sizes) < 1 or min(args.context, args.prompt_len, args.steps) < 1:
        raise ValueError("--batch-sizes, --context, --prompt-len and --steps must be >= 1")
    report = run_roofline(
        engine_config_from_args(args), batch_sizes, args.context, args.prompt_len, args.steps
    )
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def run_step_overhead(args: argparse.Namespace) -> int:
    import dataclasses

    from nori.bench.step_overhead import default_config, format_report, run_step_overhead

    batch_sizes = _batch_sizes(args.batch_sizes, "64,256")
    if min(batch_sizes) < 1 or min(args.prompt_len, args.steps, args.repeats) < 1:
        raise ValueError("--batch-sizes, --prompt-len, --steps and --repeats must be >= 1")
    config = dataclasses.replace(
        default_config(),
        device=args.device,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
    )
    if args.model is not None:
        config = dataclasses.replace(config, model=args.model)
    report = run_step_overhead(config, batch_sizes, args.prompt_len, args.steps, args.repeats)
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
    print_report(measure_fidelity(settings).as_dict(), args.json)
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
        print_report(report, as_json=True)
    else:
        print(format_report(result))
    return 0


def run_moe_decode(args: argparse.Namespace) -> int:
    from nori.bench.moe_decode import format_report, run_moe_decode_benchmark

    sizes = tuple(int(size) for size in args.batch_sizes.split(","))
    if min(sizes) < 1 or args.rounds < 1 or args.steps < 1 or args.context < 1:
        raise ValueError("--batch-sizes, --rounds, --steps and --context must be >= 1")
    args.model = args.dense_model
    report = run_moe_decode_benchmark(
        engine_config_from_args(args),
        dense_model=args.dense_model,
        moe_model=args.moe_model,
        batch_sizes=sizes,
        context=args.context,
        steps=args.steps,
        rounds=args.rounds,
    )
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
