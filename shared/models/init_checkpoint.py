"""Writes random-weight checkpoints in Hugging Face layout (`nori model init DIR --preset NAME`),
byte-identical for the same (preset, seed, shard size)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from nori.models.config import ModelConfig
from nori.models.dtypes import checkpoint_dtype
from nori.models.llama import CausalLM
from nori.models.presets import get_preset
from nori.models.tokenizer_builder import build_tokenizer_json, tokenizer_config

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_INIT_STD = 0.02  # transformers' default initializer_range


def init_checkpoint(
    directory: str | Path,
    preset: str | ModelConfig,
    seed: int = 0,
    write_weights: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Writes a preset (its name, or a shape of its own) into `directory`, created if needed,
    and returns the folder's path. With `write_weights=False` only config and tokenizer are
    written, enough for `load_model(..., load_format="dummy")`."""
    config = get_preset(preset) if isinstance(preset, str) else preset
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", config.to_dict())
    _write_json(folder / "generation_config.json", _generation_config(config))
    (folder / "tokenizer.json").write_text(build_tokenizer_json(config.vocab_size), "utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config(config.max_position_embeddings))
    if write_weights:
        _write_weights(folder, config, seed, max_shard_bytes)
    return folder


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, in writing order, for a model of this config."""
    model = CausalLM(config, device="meta")
    return {name: tuple(target.view().shape) for name, target in model.hf_weight_targets().items()}


def _write_weights(folder: Path, config: ModelConfig, seed: int, max_shard_bytes: int) -> None:
    dtype = checkpoint_dtype(config) or torch.float32
    shards = _plan_shards(checkpoint_shapes(config), dtype.itemsize, max_shard_bytes)
    generator = torch.Generator().manual_seed(seed)
    if len(shards) == 1:
        file_names = ["model.safetensors"]
    else:
        file_names = [
            f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            for index in range(len(shards))
        ]
    weight_map: dict[str, str] = {}
    total_bytes = 0
    # One shard in memory at a time: the 8B preset is 16 GB in bf16.
    for file_name, shard in zip(file_names, shards, strict=True):
        tensors = {name: _random_tensor(name, shape, dtype, generator) for name, shape in shard}
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total_bytes += tensor.numel() * tensor.element_size()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _write_json(folder / "model.safetensors.index.json", index)


def _plan_shards(
    shapes: dict[str, tuple[int, ...]], itemsize: int, max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy packing in order; a tensor bigger than the limit gets a shard of its own."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape in shapes.items():
        size = itemsize
        for extent in shape:
            size *= extent
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += size
    return shards


def _random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    # Drawn in float32 on the CPU so the values do not depend on dtype support or device.
    return (torch.randn(shape, generator=generator) * _INIT_STD).to(dtype)


def _generation_config(config: ModelConfig) -> dict[str, Any]:
    eos = list(config.eos_token_id)
    return {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", "utf-8")
