"""Test-session setup that must happen before any test module imports triton or nori.

Without a GPU, Triton kernels run in Triton's CPU interpreter, which triton reads from
TRITON_INTERPRET when a function is decorated: set it before anything is imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
