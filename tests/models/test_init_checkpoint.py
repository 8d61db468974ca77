from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from nori.models.config import ModelConfig
from nori.models.errors import ModelLoadError
from nori.models.init_checkpoint import init_checkpoint
from nori.models.presets import PRESETS

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    first = init_checkpoint(tmp_path / "a", "tiny-qwen2", seed=3)
    second = init_checkpoint(tmp_path / "b", "tiny-qwen2", seed=3)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    first = load_file(str(init_checkpoint(tmp_path / "a", "tiny", seed=0) / "model.safetensors"))
    second = load_file(str(init_checkpoint(tmp_path / "b", "tiny", seed=1) / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not first[name].equal(second[name])
    assert first["model.norm.weight"].equal(second["model.norm.weight"])  # norms are ones


def test_written_config_matches_preset(tmp_path: Path) -> None:
    folder = init_checkpoint(tmp_path / "q3", "tiny-qwen3")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 16
    assert ModelConfig.from_dir(folder) == PRESETS["tiny-qwen3"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(PRESETS["tiny-qwen3"].eos_token_id)


def test_tied_checkpoint_has_no_lm_head(tmp_path: Path) -> None:
    tensors = load_file(str(init_checkpoint(tmp_path / "q2", "tiny-qwen2") / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    assert "model.layers.0.self_attn.q_proj.bias" in tensors


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-0.6b"])
def test_big_presets_without_weights(tmp_path: Path, preset: str) -> None:
    folder = init_checkpoint(tmp_path / preset, preset, write_weights=False)
    assert not list(folder.glob("*.safetensors"))
    assert ModelConfig.from_dir(folder) == PRESETS[preset]


def test_unknown_preset_lists_known(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tiny-qwen3"):
        init_checkpoint(tmp_path, "gpt5")
