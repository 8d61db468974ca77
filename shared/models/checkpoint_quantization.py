"""A checkpoint's own 8-bit weights: the formats that load as they are, a clear error for others.

Supported: FP8 `compressed-tensors` with per-tensor or per-channel scales, kept bit for bit (a
per-tensor scale repeated over rows). Activations stay full precision."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nori.models.errors import ModelLoadError
from nori.models.quantization import WeightOnlyLinear

_WEIGHT_STRATEGIES = ("tensor", "channel")
_SCALE_SUFFIX = ".weight_scale"
_UNUSED_SUFFIXES = (".input_scale", ".weight_zero_point", ".input_zero_point")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's checked `quantization_config`: only "fp8" for now."""

    method: str
    source: str


def checkpoint_quantization(folder: Path) -> CheckpointQuantization | None:
    """None for a full-precision checkpoint; ModelLoadError for a format Nori cannot load."""
    config_path = folder / "config.json"
    data: dict[str, Any] = json.loads(config_path.read_text())
    config = data.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method != "compressed-tensors":
        raise _unsupported(config_path, f"quant_method {method!r}")
    groups = config.get("config_groups") or {}
    if not groups:
        raise _unsupported(config_path, "compressed-tensors without config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        scheme = (weights.get("num_bits"), weights.get("type"), weights.get("strategy"))
        if scheme[:2] != (8, "float") or scheme[2] not in _WEIGHT_STRATEGIES:
            raise _unsupported(
                config_path,
                f"config group {name!r} with {scheme[0]}-bit {scheme[1]} weights, "
                f"strategy {scheme[2]!r}",
            )
    return CheckpointQuantization("fp8", str(config_path))


def _unsupported(config_path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{config_path}: quantized checkpoint with {what} is not supported. Nori loads FP8 "
        "checkpoints in the compressed-tensors format (per-tensor or per-channel weight scales), "
        "or quantizes a full-precision checkpoint at load with --quantization int8|fp8"
    )


@dataclass
class _Part:
    rows: tuple[int | None, int | None]
    weight: torch.Tensor | None = None
    scale: torch.Tensor | None = None


@dataclass
class Fp8Weights:
    """Collects a checkpoint's fp8 weights and scales while it loads (instead of copying them into
    the `targets` parameters), then swaps the layers."""

    targets: dict[str, Any]
    _parts: dict[str, _Part] = field(default_factory=dict)

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keeps the tensor if it belongs to a quantized layer; False for an ordinary one."""
        if name.endswith(_UNUSED_SUFFIXES):
            return True
        if name.endswith(_SCALE_SUFFIX):
            weight_name = name.removesuffix("_scale")
            self._part(weight_name).scale = tensor.float().reshape(-1)
            return True
        if tensor.dtype is torch.float8_e4m3fn:
            self._part(name).weight = tensor
            return True
        return False

    def _part(self, weight_name: str) -> _Part:
        target = self.targets.get(weight_name)
        if target is None:
            raise ModelLoadError(f"quantized tensor {weight_name} names no layer of this model")
        return self._parts.setdefault(weight_name, _Part((target.start, target.stop)))

    def loaded_names(self) -> set[str]:
        return {name for name, part in self._parts.items() if part.weight is not None}

    def install(self, model: nn.Module) -> int:
        """Replaces each layer whose weight came in fp8; returns how many."""
        by_parameter: dict[int, list[_Part]] = {}
        for name, part in self._parts.items():
            if part.weight is None or part.scale is None:
                missing = "weight" if part.weight is None else "weight_scale"
                raise ModelLoadError(f"quantized layer {name} has no {missing} in the checkpoint")
            by_parameter.setdefault(id(self.targets[name].parameter), []).append(part)
        replaced = 0
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and id(child.weight) in by_parameter:
                    parts = by_parameter[id(child.weight)]
                    setattr(parent, child_name, _assemble(child, parts))
                    replaced += 1
        return replaced


def _assemble(linear: nn.Linear, parts: list[_Part]) -> WeightOnlyLinear:
    out_features, in_features = linear.weight.shape
    device = linear.weight.device
    qweight = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(out_features, dtype=torch.float32, device=device)
    covered = 0
    for part in parts:
        assert part.weight is not None and part.scale is not None
        start, stop = part.rows
        rows = slice(start or 0, out_features if stop is None else stop)
        num_rows = rows.stop - rows.start
        if part.weight.shape != (num_rows, in_features) or part.scale.numel() not in (1, num_rows):
            raise ModelLoadError(
                f"a quantized part of shape {tuple(part.weight.shape)} with "
                f"{part.scale.numel()} scales does not fit rows {rows.start}:{rows.stop} of a "
                f"[{out_features}, {in_features}] layer"
            )
        qweight[rows] = part.weight.to(device)
        scale[rows] = part.scale.to(device).expand(num_rows)
        covered += num_rows
    if covered != out_features:
        raise ModelLoadError(
            f"only {covered} of {out_features} rows of a fused layer are quantized in the "
            "checkpoint (mixed fp8 and full-precision parts are not supported)"
        )
    bias = None if linear.bias is None else linear.bias.detach()
    return WeightOnlyLinear(qweight, scale, bias)
