"""A model folder in the cache, built once: the built-in checkpoints and converted GGUF files."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(folder)` unless it already holds a config.json: built in a
    temporary sibling folder, then renamed (concurrent builds: one rename wins), so no reader
    sees a half-written folder and a failed build leaves nothing behind."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process renamed its copy first; theirs is identical, keep it.
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
