"""LLMEngine's docstring names every public member, and nothing else: the surface is the list."""

from __future__ import annotations

import re
from pathlib import Path

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.models.init_checkpoint import init_checkpoint


def documented_members() -> list[str]:
    doc = LLMEngine.__doc__ or ""
    listed = doc[doc.index("Its members") :]
    return re.findall(r"`(\w+)`", listed)


def test_the_docstring_lists_exactly_the_public_members(tmp_path: Path) -> None:
    init_checkpoint(tmp_path, "tiny", seed=0)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16))
    public = {name for name in dir(engine) if not name.startswith("_")}
    documented = documented_members()
    assert len(documented) == len(set(documented)), f"named twice: {documented}"
    assert set(documented) == public
