"""`nori generate`: complete prompts offline and print the results."""

from __future__ import annotations

import argparse
import json

from nori.cli.engine_args import add_engine_args, engine_config_from_args
from nori.settings import settings_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts offline")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
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
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, output in zip(args.prompt, outputs, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": output.text,
                "token_ids": output.token_ids,
                "prompt_token_ids": output.prompt_token_ids,
                "finish_reason": output.finish_reason,
                "stop_reason": output.stop_reason,
                "num_cached_tokens": output.num_cached_tokens,
            }
            if output.logprobs is not None:
                record["logprobs"] = [
                    {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top}
                    for lp in output.logprobs
                ]
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            print(f"--- {prompt!r} ({output.finish_reason}, {len(output.token_ids)} tokens)")
            print(output.text, flush=True)
    return 0
