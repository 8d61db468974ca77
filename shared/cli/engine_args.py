"""Command-line flags shared by every command that builds an engine."""

from __future__ import annotations

import argparse

from nori.engine.config import EngineConfig
from nori.settings import DEFAULT_BLOCK_SIZE


def prefill_budget(text: str) -> int | str | None:
    """--prefill-budget-with-decodes: "auto", a number of tokens, or 0 for no cap."""
    if text == "auto":
        return "auto"
    try:
        tokens = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a number of tokens, got {text!r}"
        ) from None
    if tokens < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or >= 0 tokens, got {tokens}")
    return tokens or None


def add_engine_args(
    parser: argparse.ArgumentParser, prefill_budget_with_decodes: str | None = None
) -> None:
    """`prefill_budget_with_decodes` is the command's default for that flag: None (no cap) for
    offline commands, "auto" for serving workers."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default="demo",
        help="a local Hugging Face checkpoint folder, or a built-in random-weight model created "
        "on first use: 'demo' (3.7M parameters) or 'small' (24M); their text is meaningless",
    )
    group.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"]
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights made on the device (benchmarks of big shapes)",
    )
    group.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--cpu-kv-cache-gib", type=float, default=1.0)
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument(
        "--prefill-budget-with-decodes",
        type=prefill_budget,
        default=prefill_budget_with_decodes,
        metavar="auto|TOKENS",
        help="prompt tokens a step may carry while streams decode in it (long prompts are cut "
        "into chunks of this size), so a prefill never stalls the running streams for long; "
        "auto = as many as cost about one decode step, learnt from the steps' timings; "
        "0 = no cap beyond --max-num-batched-tokens (default: %(default)s)",
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "triton", "cpu", "reference"],
        help="auto: Triton kernels on GPU, the C++ CPU kernels on CPU (NORI_CPU_KERNELS=0: "
        "the PyTorch references)",
    )


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    options: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "load_format": args.load_format,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "cpu_kv_cache_gib": args.cpu_kv_cache_gib,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_budget_with_decodes": args.prefill_budget_with_decodes,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
        "attention_backend": args.attention_backend,
    }
    options.update(overrides)
    return EngineConfig(**options)  # type: ignore[arg-type]


def worker_args(text: str) -> tuple[str, ...]:
    """--worker-args (`nori up`, `nori bench compare`): checked against the engine options."""
    import shlex

    tokens = tuple(shlex.split(text))
    if any(token == "--model" or token.startswith("--model=") for token in tokens):
        raise ValueError("--worker-args: give the model with --model")
    parser = argparse.ArgumentParser(prog="--worker-args", add_help=False, exit_on_error=False)
    add_engine_args(parser)
    try:
        _, unknown = parser.parse_known_args(tokens)
    except argparse.ArgumentError as error:
        raise ValueError(f"--worker-args: {error}") from None
    if unknown:
        raise ValueError(f"--worker-args: not an engine option: {' '.join(unknown)}")
    return tokens
