"""Command-line flags shared by every command that builds an engine."""

from __future__ import annotations

import argparse
from typing import get_args

from nori.engine.config import (
    AttentionBackend,
    Dtype,
    EngineConfig,
    KVCacheDtype,
    LoadFormat,
    PrefillBudget,
    Quantization,
    SpeculativeConfig,
)
from nori.settings import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL


def prefill_budget(text: str) -> PrefillBudget:
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


# --prefill-budget-with-decodes of a serving worker: no cap beyond --max-num-batched-tokens, as
# vLLM's chunked prefill; "auto" favours inter-token latency over throughput.
SERVING_PREFILL_BUDGET: str | None = None

# --prefill-budget-with-decodes not given to `nori serve decode`: decided by `role_prefill_budget`
# (an int: argparse would parse a string default as if given).
ROLE_PREFILL_BUDGET = -1


def role_prefill_budget(given: object, colocated: bool) -> object:
    """--prefill-budget-with-decodes as given, else by role: "auto" for a decode worker (its
    prompts run beside streams), the serving default for a colocated one."""
    if given != ROLE_PREFILL_BUDGET:
        return given
    return SERVING_PREFILL_BUDGET if colocated else "auto"


# --background-prefill-budget of a serving worker.
SERVING_BACKGROUND_PREFILL_BUDGET = 256


def _whole_number(text: str, minimum: int, unit: str = "") -> int:
    """`text` as an int of at least `minimum`, else argparse's error naming the `unit`."""
    try:
        number = int(text)
    except ValueError:
        what = f"a number of {unit}" if unit else "a whole number"
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if number < minimum:
        raise argparse.ArgumentTypeError(
            f"must be >= {minimum}{' ' + unit if unit else ''}, got {number}"
        )
    return number


def positive_int(text: str) -> int:
    return _whole_number(text, 1)


def _non_negative_tokens(text: str) -> int:
    return _whole_number(text, 0, "tokens")


def add_engine_args(
    parser: argparse.ArgumentParser,
    prefill_budget_with_decodes: str | int | None = None,
    *,
    background_prefill_budget: int = 0,
    with_model: bool = True,
) -> list[argparse.Action]:
    """`prefill_budget_with_decodes` and `background_prefill_budget` are the command's defaults
    for those flags. Returns the options added."""
    group = parser.add_argument_group("engine")
    if with_model:
        group.add_argument(
            "--model",
            default=DEFAULT_MODEL,
            help="a local Hugging Face checkpoint folder, a .gguf file, "
            "'smollm2-135m-instruct' (SmolLM2-135M-Instruct, installed by scripts/bootstrap), or a built-in random-weight model for tests, created on first "
            "use: 'demo' (3.7M parameters), 'small' (24M) or 'small-moe' (75M, 8 experts, 2 "
            "active); their text is meaningless",
        )
    group.add_argument(
        "--tokenizer",
        default=None,
        metavar="FOLDER|FILE.gguf|NAME",
        help="whose tokenizer and chat template to use, as --model takes it (default: the "
        "model's own; a GGUF file's are its own)",
    )
    group.add_argument(
        "--dtype",
        default="auto",
        choices=get_args(Dtype),
        help="auto: the checkpoint's half type on GPU (else bfloat16); on CPU bfloat16 for a "
        "half-type checkpoint where the CPU has bf16 instructions (AVX-512 BF16 or AMX), else "
        "float32",
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument(
        "--quantization",
        default=None,
        choices=get_args(Quantization),
        help="8-bit weights (one scale per output channel) for every linear layer of the "
        "decoder, made at load: int8 runs on the x86 int8 GEMM on CPU, both on a Triton kernel "
        "on GPU; fp8 on CPU is exact but slow (no fp8 GEMM there)",
    )
    group.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="with --quantization, the LM head too (the embedding table stays as it is)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=get_args(KVCacheDtype),
        help="auto: the KV cache in the model's dtype; int8 or fp8: 8-bit codes with a "
        "float16 scale per token and kv head, about twice the tokens of bf16 in the same "
        "memory (four times float32's); prefill and decode workers must agree",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model across this many ranks (processes; gloo on CPU, NCCL on GPU), "
        "each with its share of the heads, MLP, vocabulary and KV cache and of the threads",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size N, a mixture-of-experts model's experts go whole to "
        "the ranks (E/N each) instead of every expert being sliced N ways; attention, dense "
        "layers and a shared expert stay tensor-parallel, and the KV layout is unchanged "
        "(a no-op for a dense model or one rank)",
    )
    group.add_argument(
        "--load-format",
        default="auto",
        choices=get_args(LoadFormat),
        help="dummy: random weights made on the device (benchmarks of big shapes)",
    )
    group.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block"
    )
    group.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV pool size (default: from memory)"
    )
    group.add_argument(
        "--cpu-kv-cache-gib",
        type=float,
        default=1.0,
        help="most KV pool memory on CPU (less when max-num-seqs full sequences need less)",
    )
    group.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use"
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly instead of replaying decode CUDA graphs",
    )
    group.add_argument("--max-num-seqs", type=int, default=256, help="most running sequences")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="most tokens in one step"
    )
    group.add_argument(
        "--prefill-budget-with-decodes",
        type=prefill_budget,
        default=prefill_budget_with_decodes,
        metavar="auto|TOKENS",
        help="prompt tokens a step may carry while streams decode in it (long prompts are cut "
        "into chunks of this size), so a prefill never stalls the running streams for long; "
        "auto = as many as cost about one decode step, learnt from the steps' timings; "
        "0 = no cap beyond --max-num-batched-tokens, the throughput setting (default: "
        f"{'0' if prefill_budget_with_decodes is None else prefill_budget_with_decodes})",
    )
    group.add_argument(
        "--background-prefill-budget",
        type=_non_negative_tokens,
        default=background_prefill_budget,
        metavar="TOKENS",
        help="prompt tokens of background requests (priority above 0: batch lines) a step may "
        "carry, so an interactive prompt arriving beside a batch waits for a short step; "
        "0 = no cap of their own (default: %(default)s)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's max_position_embeddings)",
    )
    group.add_argument(
        "--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks"
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of dummy weights and of unseeded sampling"
    )
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=get_args(AttentionBackend),
        help="auto: Triton kernels on GPU, the C++ CPU kernels on CPU (NORI_CPU_KERNELS=0: "
        "the PyTorch references)",
    )
    group.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding, as vLLM's: a proposer drafts tokens that one step of the "
        "model verifies. Keys: method (ngram: lookup in the request's own tokens, or "
        "draft_model: a smaller model, given as model), num_speculative_tokens, "
        "prompt_lookup_max, prompt_lookup_min, disable_by_batch_size; e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; '
        "every worker of a cluster must run with the same (none: off)",
    )
    return list(group._group_actions)


def prefill_budget_by_role(parser: argparse.ArgumentParser) -> None:
    """--prefill-budget-with-decodes left to each worker's role when not given; a given value,
    0 included, is then passed on by `changed_engine_flags`."""
    parser.set_defaults(prefill_budget_with_decodes=ROLE_PREFILL_BUDGET)
    for action in parser._actions:
        if action.dest == "prefill_budget_with_decodes":
            # "%(default).0s" prints nothing: it keeps the formatter from adding "(default: -1)".
            action.help = (action.help or "").split(" (default:")[0] + (
                " (default: auto on a decode worker, 0 on a colocated one)%(default).0s"
            )


def speculative_config_from_flag(text: str | None) -> SpeculativeConfig | None:
    """--speculative-config's JSON as the engine takes it (None when not given), parsed here so
    a bad value is one `nori: error:` line."""
    if text is None:
        return None
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as error:
        raise ValueError(f"--speculative-config: {error}") from None


def changed_engine_flags(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The engine options on a launcher's command line that differ from the default, as flags."""
    flags: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a switch such as --no-prefix-caching
            flags.append(flag)
        else:
            flags += [flag, "0" if value is None else str(value)]
    return flags


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    options: dict[str, object] = {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "dtype": args.dtype,
        "device": args.device,
        "quantization": args.quantization,
        "quantize_lm_head": args.quantize_lm_head,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "load_format": args.load_format,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "cpu_kv_cache_gib": args.cpu_kv_cache_gib,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_budget_with_decodes": role_prefill_budget(
            args.prefill_budget_with_decodes, getattr(args, "colocated", False)
        ),
        "background_prefill_budget": args.background_prefill_budget or None,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
        "attention_backend": args.attention_backend,
        "speculative_config": speculative_config_from_flag(args.speculative_config),
        "enforce_eager": args.enforce_eager,
    }
    options.update(overrides)
    return EngineConfig(**options)  # type: ignore[arg-type]


def add_engine_core_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--engine-core",
        default="auto",
        choices=["auto", "process", "thread"],
        help="where a worker's engine loop runs: a process of its own beside the worker's gRPC "
        "and transfers (as vLLM's engine core), or a thread of the worker; auto = a process for "
        "a CPU worker with 2 or more CPUs and one rank, else a thread (default %(default)s)",
    )


def speculative_config_of(worker_flags: tuple[str, ...]) -> SpeculativeConfig | None:
    """The speculative decoding a worker started with these (checked) engine flags runs."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    add_engine_core_arg(parser)
    return speculative_config_from_flag(parser.parse_known_args(worker_flags)[0].speculative_config)


def worker_args(text: str, flag: str = "--worker-args") -> tuple[str, ...]:
    """--worker-args (`flag` names another such option in messages), checked against the engine
    options and --engine-core."""
    import shlex

    tokens = tuple(shlex.split(text))
    if any(token == "--model" or token.startswith("--model=") for token in tokens):
        raise ValueError(f"{flag}: give the model with --model")
    parser = argparse.ArgumentParser(prog=flag, add_help=False, exit_on_error=False)
    add_engine_args(parser)
    add_engine_core_arg(parser)
    try:
        parsed, unknown = parser.parse_known_args(tokens)
    except argparse.ArgumentError as error:
        raise ValueError(f"{flag}: {error}") from None
    if unknown:
        raise ValueError(f"{flag}: not an engine option: {' '.join(unknown)}")
    try:
        speculative_config_from_flag(parsed.speculative_config)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None
    return tokens
