"""The `nori bench serve` command-line options, and the settings they make.

The workload options (dataset, load, SLOs) are also `nori bench compare`'s: `add_workload_args`
and `workload_settings_from_args` serve both commands.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from nori.bench.serve.settings import (
    DATASETS,
    ENDPOINT_PATHS,
    PROMPT_FORMATS,
    SERVER_FIELDS,
    ServeBenchSettings,
)
from nori.settings import settings_from

_DEFAULTS = ServeBenchSettings()


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    _add_server_args(parser)
    add_workload_args(parser)
    _add_output_args(parser)


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=_DEFAULTS.base_url)
    server.add_argument(
        "--endpoint-type",
        choices=tuple(ENDPOINT_PATHS),
        default=_DEFAULTS.endpoint_type,
        help="completions: /v1/completions; chat: /v1/chat/completions with one user message",
    )
    server.add_argument(
        "--model", help="model name in the requests (default: the server's first model)"
    )
    server.add_argument(
        "--tokenizer",
        help="model folder, or 'demo', whose tokenizer builds the prompts "
        "(default: --model when it is a local folder, else demo)",
    )
    server.add_argument(
        "--metrics-url",
        action="append",
        dest="metrics_urls",
        metavar="URL",
        help="Prometheus endpoint read before and after the run for speculative decoding's "
        "acceptance (repeatable, e.g. each worker's; default: BASE_URL/metrics, which on a "
        "Nori gateway carries every worker's counters)",
    )


def _add_option(group: argparse._ArgumentGroup, flag: str, help: str | None = None) -> None:
    """An option whose type and default are those of the settings field of the same name."""
    default = getattr(_DEFAULTS, flag.removeprefix("--").replace("-", "_"))
    group.add_argument(flag, type=type(default), default=default, help=help)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """What is sent, when, and how it is judged."""
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default=_DEFAULTS.dataset)
    data.add_argument("--dataset-path", help="ShareGPT JSON file (--dataset sharegpt, copy)")
    _add_option(data, "--num-prompts")
    data.add_argument(
        "--duration",
        type=float,
        help="send for this many seconds, cycling the dataset, then wait for those in flight",
    )
    _add_option(data, "--random-input-len")
    _add_option(data, "--random-output-len")
    _add_option(data, "--random-range-ratio", "lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default=_DEFAULTS.prompt_format,
        help="token-ids sends the completions prompt as token ids (exact lengths)",
    )
    for flag in ("--prefix-num-groups", "--prefix-len", "--suffix-len", "--prefix-output-len"):
        _add_option(data, flag)
    _add_option(data, "--copy-input-len", "longest prompt of the copy dataset (tokens)")
    _add_option(data, "--copy-output-len", "max_tokens of the copy dataset's requests")
    _add_option(data, "--long-input-len", "the mixed dataset's long prompts (tokens, >= 1000)")
    _add_option(data, "--long-range-ratio", "long prompt lengths uniform in [len*(1-r), len*(1+r)]")
    _add_option(data, "--long-output-len")
    _add_option(
        data,
        "--long-request-rate",
        "long requests per second of the mixed dataset, on their own Poisson clock",
    )
    data.add_argument(
        "--long-fraction",
        type=float,
        default=_DEFAULTS.long_fraction,
        metavar="F",
        help="instead of --long-request-rate: this fraction of the mixed dataset's requests is "
        "long, on the main arrival process (e.g. 0.2: --request-rate sets both classes' rate)",
    )
    data.add_argument(
        "--max-model-len", type=int, help="drop ShareGPT pairs longer than the server's context"
    )

    load = parser.add_argument_group("load")
    _add_option(load, "--request-rate", "requests per second (default inf: all at once)")
    _add_option(
        load, "--burstiness", "gamma shape of the gaps: 1 Poisson, < 1 burstier, > 1 more regular"
    )
    load.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    for flag in ("--num-warmups", "--seed", "--temperature", "--request-timeout-s"):
        _add_option(load, flag)
    load.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM and Nori)"
    )

    slo = parser.add_argument_group("service-level objectives")
    slo.add_argument("--slo-ttft-ms", type=float, help="TTFT limit for effective throughput")
    slo.add_argument("--slo-tpot-ms", type=float, help="TPOT limit for effective throughput")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument("--result-file", help="also write the JSON result to this file")
    output.add_argument(
        "--save-detailed", action="store_true", help="add every request's record to the JSON"
    )
    output.add_argument("--plot", help="write TTFT/ITL CDFs and tokens/s over time to FILE.png")


def settings_from_args(args: argparse.Namespace) -> ServeBenchSettings:
    return replace(
        workload_settings_from_args(args),
        base_url=args.base_url.rstrip("/"),
        endpoint_type=args.endpoint_type,
        model=args.model,
        tokenizer=args.tokenizer,
        metrics_urls=tuple(args.metrics_urls or ()),
    )


def workload_settings_from_args(args: argparse.Namespace) -> ServeBenchSettings:
    """The options of `add_workload_args`; the server's fields keep their defaults."""
    return settings_from(ServeBenchSettings, args, exclude=SERVER_FIELDS, duration_s=args.duration)
