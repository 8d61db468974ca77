"""Per-request sampling parameters with vLLM's `SamplingParams` fields and ranges, validated
once in `__post_init__`, so an invalid object never exists."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Below this a temperature is treated as greedy, as vLLM does.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    # bool is a subclass of int; `max_tokens=True` is a bug, not a request for one token.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value: object, low: float, high: float, allowed: str) -> None:
    if not _is_number(value) or not (low <= float(value) <= high):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, Iterable):
        raise ValueError(f"stop must be a string or a sequence of strings, got {stop!r}")
    result = tuple(items)
    for item in result:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must contain only non-empty strings, got {item!r}")
    return result


def _normalise_token_ids(token_ids: object) -> tuple[int, ...]:
    if token_ids is None:
        return ()
    if _is_int(token_ids) or not isinstance(token_ids, Iterable):
        raise ValueError(f"stop_token_ids must be a sequence of ints >= 0, got {token_ids!r}")
    result = tuple(token_ids)
    for item in result:
        if not _is_int(item) or item < 0:
            raise ValueError(f"stop_token_ids must contain only ints >= 0, got {item!r}")
    return result


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop it (vLLM semantics). `stop` and
    `stop_token_ids` become tuples; each of the `n` completions is one engine request."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's `prompt_logprobs`: the prompt tokens' log-probabilities and this many alternatives
    # (the first token has none). Such a request is computed in full, no prefix cache.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_token_ids(self.stop_token_ids))
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        _check_number("temperature", self.temperature, 0.0, float("inf"), ">= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or an int >= 1, got {self.top_k!r}")
        _check_number("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}"
            )
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
                )

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SamplingParams:
        """Builds params from a request body, rejecting unknown keys."""
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**fields)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @functools.cached_property
    def is_plain_greedy(self) -> bool:
        """Greedy, no penalties, no logprobs: only an argmax (once past min_tokens)."""
        return self.is_greedy and not self.has_penalties and self.logprobs is None

    @functools.cached_property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of a prompt's n choices, each an engine request (n=1); with a seed,
    choice i samples with seed + i."""
    single = params if params.n == 1 else dataclasses.replace(params, n=1)
    if single.seed is None or n == 1:
        return [single] * n
    return [
        # Wrapped into the int64 range seeds have on the wire.
        dataclasses.replace(single, seed=(single.seed + i + 2**63) % 2**64 - 2**63)
        for i in range(n)
    ]
