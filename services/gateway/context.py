"""What the OpenAI endpoints share for the server's lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from nori.gateway.backend import Backend
from nori.gateway.metrics import GatewayMetrics
from nori.sampling.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServingContext:
    backend: Backend
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: GatewayMetrics
    # Keeps the per-prompt producer tasks referenced until they end.
    tasks: set[asyncio.Task[None]]
    # token id -> its text, cached (see create_app).
    token_text: Callable[[int], str]
