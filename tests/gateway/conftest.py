"""A tiny random checkpoint shared by the gateway tests (written once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("gateway-tiny"), "tiny", seed=11)


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)
