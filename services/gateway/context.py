"""What the OpenAI endpoints share for the server's lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from nori.gateway.backend import Backend
from nori.gateway.metrics import GatewayMetrics
from nori.sampling.chat_template import TemplateLimits
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
    # The most UTF-8 bytes one token's text has: a text of B bytes has at least
    # B / max_token_bytes tokens, so a hopeless prompt is refused without tokenizing it.
    max_token_bytes: int = 64
    # --stream-interval: a streamed request's outputs come this many tokens to a message.
    stream_interval: int = 1
    # What one chat template render may do (steps, size, time), the request's or the server's.
    template_limits: TemplateLimits = field(default_factory=TemplateLimits)
