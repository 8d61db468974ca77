"""Builds a `CausalLM` from a Hugging Face folder: config.json plus safetensors weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from nori.models.checkpoint_quantization import Fp8Weights, checkpoint_quantization
from nori.models.config import ModelConfig
from nori.models.errors import ModelLoadError
from nori.models.llama import CausalLM, WeightTarget
from nori.models.packed_linear import pack_bf16_linears
from nori.models.quantization import quantize_model
from nori.models.shard import shard_model
from nori.parallel.group import TensorParallelGroup

LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "dummy")

# Checkpoint tensors that some exporters include but that are derived, not learned.
_IGNORED_SUFFIXES: tuple[str, ...] = (
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)

_DUMMY_STD = 0.02


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    tensor_parallel: TensorParallelGroup | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """The model in eval mode without gradients, on `device` in `dtype`.

    `tensor_parallel`: cut to that rank's shard (nori.models.shard) before quantizing.
    `load_format="dummy"`: seeded random weights made on the device (benchmarks).
    `quantization` ("int8", "fp8"): 8-bit decoder linears once the weights are in."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    folder = Path(model_dir)
    config = ModelConfig.from_dir(folder)
    stored = checkpoint_quantization(folder)
    if stored is not None and tensor_parallel is not None:
        raise ModelLoadError(
            f"{folder} is already quantized ({stored.method}); tensor parallelism of a "
            "pre-quantized checkpoint is not supported yet"
        )
    if stored is not None and quantization is not None:
        raise ModelLoadError(
            f"{folder} is already quantized ({stored.method}, from {stored.source}); "
            "drop --quantization to serve its own weights"
        )
    if stored is not None and load_format == "dummy":
        raise ModelLoadError(f"{folder} is quantized: --load-format dummy cannot fill it")
    device = torch.device(device)
    # Built on "meta" then materialized: no wasted init, no float32 copy of a bf16 model.
    model = CausalLM(config, dtype=dtype, device="meta").to_empty(device=device)
    model.reset_buffers()
    with torch.no_grad():
        if load_format == "dummy":
            _fill_random(model, seed)
        else:
            _load_safetensors(model, folder, device, quantized=stored is not None)
    model.requires_grad_(False)
    if tensor_parallel is not None:
        shard_model(model, tensor_parallel)
    if quantization is not None:
        quantize_model(model, quantization, include_lm_head=quantize_lm_head)
    if device.type == "cpu":
        if dtype is torch.bfloat16:
            pack_bf16_linears(model)
        model.store_weights_transposed()  # whatever is still a plain nn.Linear
    return model.eval(), config


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those the index names when there is one, else `*.safetensors`."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [path.name for path in files if not path.is_file()]
        if absent:
            raise ModelLoadError(f"{index_path} names shard files that are missing: {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in model folder {folder} (a folder written with "
            "`nori model init --no-weights` needs --load-format dummy)"
        )
    return files


def _load_safetensors(
    model: CausalLM, folder: Path, device: torch.device, quantized: bool = False
) -> None:
    targets = model.hf_weight_targets()
    loaded: set[str] = set()
    unexpected: list[str] = []
    fp8 = Fp8Weights(targets) if quantized else None
    for path in safetensors_files(folder):
        # One tensor at a time straight onto the device: host memory holds at most one.
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensor = handle.get_tensor(name)
                if fp8 is not None and fp8.take(name, tensor):
                    continue
                target = targets.get(name)
                if target is None:
                    if not _ignorable(name, model):
                        unexpected.append(name)
                    continue
                _copy_into(target, tensor, name, path)
                loaded.add(name)
    if fp8 is not None:
        loaded |= fp8.loaded_names()
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise ModelLoadError(
            f"weights in {folder} do not match the {model.config.architecture} config: "
            f"missing {_summary(missing)}; unexpected {_summary(sorted(unexpected))}"
        )
    if fp8 is not None:
        fp8.install(model)


def _ignorable(name: str, model: CausalLM) -> bool:
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return True
    return name.endswith(_IGNORED_SUFFIXES)


def _copy_into(target: WeightTarget, tensor: torch.Tensor, name: str, path: Path) -> None:
    destination = target.view()
    if destination.shape != tensor.shape:
        raise ModelLoadError(
            f"{path.name}: tensor {name} has shape {tuple(tensor.shape)}, "
            f"the config implies {tuple(destination.shape)}"
        )
    destination.copy_(tensor)


def _summary(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _fill_random(model: CausalLM, seed: int) -> None:
    """Norm weights 1, everything else normal(0, 0.02): the usual initializer_range."""
    generator = torch.Generator(device=model.model.norm.weight.device).manual_seed(seed)
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.fill_(1.0)
        else:
            parameter.normal_(0.0, _DUMMY_STD, generator=generator)
