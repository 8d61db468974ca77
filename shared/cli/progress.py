"""The progress bar of the commands that run long offline work (`generate`, `bench offline`)."""

from __future__ import annotations

import argparse
import sys


def add_progress_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress",
        "--disable-progress-bar",
        dest="progress",
        action="store_false",
        help="draw no progress bar (one is drawn on stderr when stderr is a terminal)",
    )


def show_progress(args: argparse.Namespace) -> bool:
    """A bar on stderr, and only on a terminal: never mixed into a log or piped output."""
    return bool(args.progress) and sys.stderr.isatty()
