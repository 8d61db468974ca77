"""Turns a `--model` argument into a model folder, creating the demo checkpoint on first use."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from nori.models.errors import ModelLoadError
from nori.models.init_checkpoint import init_checkpoint

DEMO_NAME = "demo"
_DEMO_FOLDER = "demo-seed0"


def default_cache_dir() -> Path:
    """`$NORI_CACHE_DIR` when set, else ~/.cache/nori/models."""
    configured = os.environ.get("NORI_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "nori" / "models"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """ "demo" -> the cached demo checkpoint (created if absent); else an existing model folder."""
    if name_or_path == DEMO_NAME:
        return ensure_demo_checkpoint(cache_dir or default_cache_dir())
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither {DEMO_NAME!r} nor an existing folder"
        )
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json")
    return folder


def ensure_demo_checkpoint(cache_dir: Path) -> Path:
    """Creates the demo checkpoint atomically: built in a temporary sibling folder, then renamed.

    Concurrent first uses each build their own copy; one rename wins and the others discard
    theirs, so no reader ever sees a half-written folder.
    """
    target = cache_dir / _DEMO_FOLDER
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{_DEMO_FOLDER}-", dir=cache_dir))
    try:
        init_checkpoint(staging, DEMO_NAME, seed=0)
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
