"""Nori: throughput-first LLM serving with disaggregated prefill and decode.

`from nori import LLM, SamplingParams, RequestOutput, CompletionOutput, EngineConfig` is the
offline API, as vLLM's; the names load lazily so that the pure-Python parts (scheduler, block
manager) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from nori.engine.completion_outputs import CompletionOutput, RequestOutput
    from nori.engine.config import EngineConfig
    from nori.engine.llm import LLM
    from nori.sampling.params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from nori.engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from nori.engine.config import EngineConfig

        return EngineConfig
    if name in ("RequestOutput", "CompletionOutput"):
        from nori.engine import completion_outputs

        return getattr(completion_outputs, name)
    if name == "SamplingParams":
        from nori.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'nori' has no attribute {name!r}")
