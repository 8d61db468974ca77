"""`nori generate`: complete prompts offline and print the results."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from nori.cli.engine_args import add_engine_args, engine_config_from_args
from nori.cli.progress import add_progress_arg, show_progress
from nori.settings import settings_from

if TYPE_CHECKING:
    from nori.engine.completion_outputs import CompletionOutput, RequestOutput


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts offline")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("-n", "--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request seed (completion i: + i)"
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per completion, on stdout"
    )
    add_progress_arg(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from nori.engine.llm import LLM
    from nori.sampling.params import SamplingParams

    params = settings_from(
        SamplingParams,
        args,
        seed=args.sampling_seed,  # --seed is the engine's
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
    )
    config = engine_config_from_args(args)
    llm = LLM(**vars(config))
    progress = show_progress(args)  # on stderr: stdout keeps only the results
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=progress)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=progress)
    for prompt, output in zip(args.prompt, outputs, strict=True):
        for completion in output.outputs:
            if args.json:
                print(json.dumps(_record(prompt, output, completion), ensure_ascii=False))
            else:
                choice = f"completion {completion.index}, " if len(output.outputs) > 1 else ""
                print(
                    f"--- {prompt!r} ({choice}{completion.finish_reason}, "
                    f"{len(completion.token_ids)} tokens)"
                )
                print(completion.text)
    sys.stdout.flush()
    return 0


def _record(prompt: str, output: RequestOutput, completion: CompletionOutput) -> dict[str, Any]:
    record: dict[str, Any] = {
        "prompt": prompt,
        "index": completion.index,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "prompt_token_ids": output.prompt_token_ids,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "num_cached_tokens": output.num_cached_tokens,
    }
    if completion.logprobs is not None:
        # Per token: the sampled one first, then the top alternatives (vLLM's order).
        record["cumulative_logprob"] = completion.cumulative_logprob
        record["logprobs"] = [
            [
                {"token_id": token_id, "logprob": entry.logprob, "rank": entry.rank}
                for token_id, entry in step.items()
            ]
            for step in completion.logprobs
        ]
    return record
