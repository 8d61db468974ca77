"""The `nori` command."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
from typing import Any

from nori.cli import bench, generate, health, model, run_batch, serve, up
from nori.parent_death import die_with_parent
from nori.settings import DEFAULT_MODEL


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: it shows defaults in --help and takes -v after its name too
    (`nori up -v` as well as `nori -v up`); its own subcommands get the same."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        # SUPPRESS: absent here, it leaves the top level's value alone.
        self.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
        )


VERBOSE_HELP = "log at INFO: lifecycle, engine details"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nori", description="Nori: throughput-first LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    generate.register(subparsers)
    model.register(subparsers)
    bench.register(subparsers)
    serve.register(subparsers)
    up.register(subparsers)
    run_batch.register(subparsers)
    health.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # A native crash still leaves its Python stacks in the log.
    faulthandler.enable()
    die_with_parent()
    args = build_parser().parse_args(argv)
    # Servers log at INFO, as vLLM does; one-shot commands keep to their results unless -v.
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "model", None) == DEFAULT_MODEL and getattr(args, "model_tag", None) is None:
        from nori.models.demo import default_model

        args.model = default_model()  # `demo` where its package is missing, said in one line
    try:
        return int(args.handler(args))
    except ValueError as error:
        # Bad input (flags, prompts, model folders): a message, not a traceback.
        print(f"nori: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nori: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
