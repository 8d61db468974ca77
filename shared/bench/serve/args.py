"""The `nori bench serve` command-line options, and the settings they make.

The workload options (dataset, load, SLOs) are also `nori bench compare`'s: `add_workload_args`
and `workload_settings_from_args` serve both commands.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from nori.bench.serve.settings import DATASETS, ENDPOINT_PATHS, PROMPT_FORMATS, ServeBenchSettings

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


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """What is sent, when, and how it is judged."""
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default=_DEFAULTS.dataset)
    data.add_argument("--dataset-path", help="ShareGPT JSON file (--dataset sharegpt)")
    data.add_argument("--num-prompts", type=int, default=_DEFAULTS.num_prompts)
    data.add_argument(
        "--duration",
        type=float,
        help="send for this many seconds, cycling the dataset, then wait for those in flight",
    )
    data.add_argument("--random-input-len", type=int, default=_DEFAULTS.random_input_len)
    data.add_argument("--random-output-len", type=int, default=_DEFAULTS.random_output_len)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=_DEFAULTS.random_range_ratio,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    data.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default=_DEFAULTS.prompt_format,
        help="token-ids sends the completions prompt as token ids (exact lengths)",
    )
    data.add_argument("--prefix-num-groups", type=int, default=_DEFAULTS.prefix_num_groups)
    data.add_argument("--prefix-len", type=int, default=_DEFAULTS.prefix_len)
    data.add_argument("--suffix-len", type=int, default=_DEFAULTS.suffix_len)
    data.add_argument("--prefix-output-len", type=int, default=_DEFAULTS.prefix_output_len)
    data.add_argument("--long-input-len", type=int, default=_DEFAULTS.long_input_len)
    data.add_argument("--long-output-len", type=int, default=_DEFAULTS.long_output_len)
    data.add_argument(
        "--long-request-rate",
        type=float,
        default=_DEFAULTS.long_request_rate,
        help="long requests per second of the mixed dataset (Poisson)",
    )
    data.add_argument(
        "--max-model-len", type=int, help="drop ShareGPT pairs longer than the server's context"
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=_DEFAULTS.request_rate,
        help="requests per second (default inf: all at once)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=_DEFAULTS.burstiness,
        help="gamma shape of the gaps: 1 Poisson, < 1 burstier, > 1 more regular",
    )
    load.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    load.add_argument("--num-warmups", type=int, default=_DEFAULTS.num_warmups)
    load.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    load.add_argument("--temperature", type=float, default=_DEFAULTS.temperature)
    load.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM and Nori)"
    )
    load.add_argument("--request-timeout-s", type=float, default=_DEFAULTS.request_timeout_s)

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
    )


def workload_settings_from_args(args: argparse.Namespace) -> ServeBenchSettings:
    """The options of `add_workload_args`; the server's fields keep their defaults."""
    return ServeBenchSettings(
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        num_prompts=args.num_prompts,
        duration_s=args.duration,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        prompt_format=args.prompt_format,
        prefix_num_groups=args.prefix_num_groups,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        prefix_output_len=args.prefix_output_len,
        long_input_len=args.long_input_len,
        long_output_len=args.long_output_len,
        long_request_rate=args.long_request_rate,
        max_model_len=args.max_model_len,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout_s,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
    )
