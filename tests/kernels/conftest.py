"""Runs the Triton kernels through Triton's CPU interpreter when there is no GPU.

The variable is set at import, before any test in this folder runs. nori.kernels applies
triton.jit lazily, at a kernel's first launch, and keys that on TRITON_INTERPRET, so this works
even when another test module imported nori.kernels (or triton) first.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
