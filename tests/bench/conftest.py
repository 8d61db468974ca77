"""Shared by the `nori bench serve` tests: a tiny model's tokenizer (no weights needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("bench") / "tiny", "tiny", write_weights=False)


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_tokenizer_dir)
