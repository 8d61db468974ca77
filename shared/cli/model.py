"""`nori model init`: write a random-weight checkpoint in Hugging Face format; `nori model
truncate`: a copy of a checkpoint's first layers (a draft model for speculative decoding)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from nori.models.presets import PRESETS

    parser = subparsers.add_parser("model", help="manage local model checkpoints")
    commands = parser.add_subparsers(dest="model_command", required=True)
    init = commands.add_parser("init", help="write a random-weight checkpoint for a preset")
    init.add_argument("directory", type=Path)
    init.add_argument("--preset", required=True, choices=sorted(PRESETS))
    init.add_argument(
        "--no-weights",
        action="store_true",
        help="write config and tokenizer only (for --load-format dummy)",
    )
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    init.add_argument(
        "--force", action="store_true", help="replace a checkpoint already in the directory"
    )
    init.set_defaults(handler=run_init)
    truncate = commands.add_parser(
        "truncate",
        help="copy a checkpoint's first N decoder layers (with its embeddings, norm, LM head and "
        "tokenizer): a draft model for --speculative-config's draft_model method",
    )
    truncate.add_argument("model", help="a checkpoint folder or a built-in/packaged model name")
    truncate.add_argument("directory", type=Path)
    truncate.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    truncate.set_defaults(handler=run_truncate)


def run_init(args: argparse.Namespace) -> int:
    from nori.models.init_checkpoint import init_checkpoint

    if (args.directory / "config.json").exists() and not args.force:
        raise ValueError(f"{args.directory} already holds a checkpoint; pass --force to replace it")
    init_checkpoint(args.directory, args.preset, seed=args.seed, write_weights=not args.no_weights)
    print(f"wrote preset {args.preset!r} (seed {args.seed}) to {args.directory}")
    return 0


def run_truncate(args: argparse.Namespace) -> int:
    from nori.models.demo import resolve_model
    from nori.models.truncate import truncate_layers

    if (args.directory / "config.json").exists():
        raise ValueError(f"{args.directory} already holds a checkpoint")
    truncate_layers(resolve_model(args.model), args.directory, args.layers)
    print(f"wrote the first {args.layers} layers of {args.model} to {args.directory}")
    return 0
