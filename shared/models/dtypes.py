"""Dtype names as configs and flags spell them, and the torch dtypes they stand for.

Apart from `config.py`, so that reading a config (the gateway does) does not load torch."""

from __future__ import annotations

import torch

from nori.models.config import ModelConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def checkpoint_dtype(config: ModelConfig) -> torch.dtype | None:
    """The checkpoint's dtype (`torch_dtype` in config.json), or None when it does not say."""
    return DTYPES.get(config.torch_dtype) if config.torch_dtype else None
