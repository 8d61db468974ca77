"""Helpers for the model tests: small random checkpoints and paths.

Kept out of conftest so tests can import them by name.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
STORIES_260K = REPO_ROOT.parent / "shared/models/stories260K"


def perturb_checkpoint(folder: Path, seed: int = 1) -> None:
    """Makes norm weights differ from 1 and biases clearly nonzero.

    Fresh checkpoints have all-ones norms, which would hide a norm loaded into the wrong place.
    """
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("norm.weight") or name.endswith(".bias"):
            noise = torch.randn(tensor.shape, generator=generator) * 0.3
            tensors[name] = (tensor.float() + noise).to(tensor.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def sample_ids(vocab_size: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
