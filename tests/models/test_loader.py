from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nori.models.errors import ModelLoadError
from nori.models.init_checkpoint import init_checkpoint
from nori.models.loader import load_model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return init_checkpoint(tmp_path / "tiny", "tiny")


def _rewrite(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name, tensor in change.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, str(path))


def test_sharded_checkpoint_loads_identically(tmp_path: Path, tiny: Path) -> None:
    sharded = init_checkpoint(tmp_path / "sharded", "tiny", max_shard_bytes=64 * 1024)
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {path.name for path in shards}
    single_state = _state(load_model(tiny, torch.float32, "cpu")[0])
    sharded_state = _state(load_model(sharded, torch.float32, "cpu")[0])
    assert single_state.keys() == sharded_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, sharded_state[name]), name


def test_loads_into_requested_dtype_without_gradients(tiny: Path) -> None:
    model, _ = load_model(tiny, torch.bfloat16, torch.device("cpu"))
    assert not model.training
    for parameter in model.parameters():
        assert parameter.dtype == torch.bfloat16 and not parameter.requires_grad


def test_missing_weights_names_folder(tmp_path: Path) -> None:
    folder = init_checkpoint(tmp_path / "empty", "tiny", write_weights=False)
    with pytest.raises(ModelLoadError, match=re.escape(str(folder))):
        load_model(folder, torch.float32, "cpu")


def test_missing_shard_named(tmp_path: Path) -> None:
    folder = init_checkpoint(tmp_path / "sharded", "tiny", max_shard_bytes=64 * 1024)
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load_model(folder, torch.float32, "cpu")


def test_missing_tensor_named(tiny: Path) -> None:
    _rewrite(tiny, {"model.layers.1.mlp.up_proj.weight": None})
    with pytest.raises(ModelLoadError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tiny, torch.float32, "cpu")


def test_unexpected_tensor_named(tiny: Path) -> None:
    _rewrite(tiny, {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(
        ModelLoadError, match=r"unexpected model\.layers\.0\.self_attn\.q_proj\.bias"
    ):
        load_model(tiny, torch.float32, "cpu")


def test_wrong_shape_named(tiny: Path) -> None:
    _rewrite(tiny, {"model.norm.weight": torch.ones(65)})
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight"):
        load_model(tiny, torch.float32, "cpu")


def test_derived_buffers_and_redundant_tied_head_tolerated(tmp_path: Path) -> None:
    folder = init_checkpoint(tmp_path / "qwen2", "tiny-qwen2")  # tied embeddings
    _rewrite(
        folder,
        {
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8),
            "lm_head.weight": torch.zeros(512, 64),
        },
    )
    model, config = load_model(folder, torch.float32, "cpu")
    assert config.tie_word_embeddings and model.lm_head is None
    assert model.model.embed_tokens.weight.abs().sum() > 0


def test_dummy_format_needs_no_weights_and_is_seeded(tmp_path: Path) -> None:
    folder = init_checkpoint(tmp_path / "shape", "tiny-qwen3", write_weights=False)
    first, _ = load_model(folder, torch.float32, "cpu", load_format="dummy")
    again, _ = load_model(folder, torch.float32, "cpu", load_format="dummy")
    other, _ = load_model(folder, torch.float32, "cpu", load_format="dummy", seed=1)
    embed = "model.embed_tokens.weight"
    assert torch.equal(_state(first)[embed], _state(again)[embed])
    assert not torch.equal(_state(first)[embed], _state(other)[embed])
    assert torch.equal(first.model.norm.weight, torch.ones(64))
    std = first.model.layers[0].mlp.down_proj.weight.std().item()
    assert 0.015 < std < 0.025


def test_unknown_load_format(tiny: Path) -> None:
    with pytest.raises(ModelLoadError, match="load_format"):
        load_model(tiny, torch.float32, "cpu", load_format="pickle")
