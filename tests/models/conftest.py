"""Fixtures for the model tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from nori.models.config import ModelConfig
from nori.models.init_checkpoint import init_checkpoint
from tests.models.model_helpers import perturb_checkpoint


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[[ModelConfig], Path]:
    counter = iter(range(1000))

    def make(config: ModelConfig) -> Path:
        folder = init_checkpoint(tmp_path / f"ckpt{next(counter)}", config, seed=0)
        perturb_checkpoint(folder)
        return folder

    return make
