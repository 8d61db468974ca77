"""Nori: throughput-first LLM serving with disaggregated prefill and decode.

`from nori import LLM, SamplingParams, RequestOutput, CompletionOutput, EngineConfig` is the
offline API, as vLLM's; the names load lazily (the pure-Python parts import without torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from nori.engine.completion_outputs import CompletionOutput, RequestOutput
    from nori.engine.config import EngineConfig
    from nori.engine.llm import LLM
    from nori.sampling.params import SamplingParams

_LAZY = {
    "LLM": "nori.engine.llm",
    "EngineConfig": "nori.engine.config",
    "RequestOutput": "nori.engine.completion_outputs",
    "CompletionOutput": "nori.engine.completion_outputs",
    "SamplingParams": "nori.sampling.params",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'nori' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
