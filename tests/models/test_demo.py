from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nori.models.config import ModelConfig
from nori.models.demo import ensure_demo_checkpoint, resolve_model
from nori.models.errors import ModelLoadError
from nori.models.presets import PRESETS


def test_demo_created_once_in_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NORI_CACHE_DIR", str(tmp_path))
    folder = resolve_model("demo")
    assert folder == tmp_path / "demo-seed0"
    assert ModelConfig.from_dir(folder) == PRESETS["demo"]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("demo") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [path.name for path in tmp_path.iterdir()] == ["demo-seed0"]  # no staging left


def test_concurrent_first_use(tmp_path: Path) -> None:
    with ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(lambda _: ensure_demo_checkpoint(tmp_path), range(3)))
    assert len(set(folders)) == 1
    assert [path.name for path in tmp_path.iterdir()] == ["demo-seed0"]


def test_existing_folder_passes_through(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model(str(tmp_path))
