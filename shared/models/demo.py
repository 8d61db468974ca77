"""Turns a `--model` argument into a model folder, creating a built-in checkpoint on first use.

The commands' default is SmolLM2-135M-Instruct (`DEFAULT_MODEL`). Built-in models are
random-weight presets with a real tokenizer, for tests: `demo`, `small` (24M parameters) and
`small-moe` (`small` with 8 experts of half its MLP, 2 active per token).
"""

from __future__ import annotations

import sys
from pathlib import Path

from nori.models.errors import ModelLoadError
from nori.models.gguf_checkpoint import (
    PACKAGED_GGUF_MODELS,
    ensure_gguf_checkpoint,
    is_gguf_path,
    packaged_gguf,
)
from nori.models.model_cache import build_once
from nori.settings import DEFAULT_MODEL, Environment

DEMO_NAME = "demo"
BUILTIN_MODELS: tuple[str, ...] = (DEMO_NAME, "small", "small-moe")


def default_model() -> str:
    """What a command serves without `--model`: SmolLM2-135M-Instruct where its package is
    installed, else `demo` (random weights), said in one line on stderr."""
    try:
        packaged_gguf(DEFAULT_MODEL)
    except ModelLoadError as error:
        print(f"nori: {error}; serving 'demo' (random weights) instead", file=sys.stderr)
        return DEMO_NAME
    return DEFAULT_MODEL


def default_cache_dir() -> Path:
    """`$NORI_CACHE_DIR` when set, else ~/.cache/nori/models."""
    return Environment.read().cache_dir or Path.home() / ".cache" / "nori" / "models"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """A built-in name -> its cached checkpoint (created if absent); a GGUF file or a packaged
    GGUF model's name -> its converted folder (see gguf_checkpoint.py); else an existing folder."""
    if name_or_path in BUILTIN_MODELS:
        return ensure_builtin_checkpoint(cache_dir or default_cache_dir(), name_or_path)
    if name_or_path in PACKAGED_GGUF_MODELS:
        return ensure_gguf_checkpoint(packaged_gguf(name_or_path), cache_dir or default_cache_dir())
    if is_gguf_path(name_or_path):
        gguf_file = Path(name_or_path).expanduser()
        return ensure_gguf_checkpoint(gguf_file, cache_dir or default_cache_dir())
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a built-in model "
            f"({', '.join(BUILTIN_MODELS + tuple(PACKAGED_GGUF_MODELS))}), a .gguf file "
            "nor an existing folder"
        )
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json")
    return folder


def ensure_demo_checkpoint(cache_dir: Path) -> Path:
    return ensure_builtin_checkpoint(cache_dir, DEMO_NAME)


def ensure_builtin_checkpoint(cache_dir: Path, name: str) -> Path:
    """Creates a built-in checkpoint once (see `build_once`: concurrent first uses are safe)."""

    def write(folder: Path) -> None:
        # Writing weights needs torch; finding an existing checkpoint (the gateway) must not.
        from nori.models.init_checkpoint import init_checkpoint

        init_checkpoint(folder, name, seed=0)

    return build_once(cache_dir / f"{name}-seed0", write)
