"""What the load generator sends: one request spec, and the run's whole workload."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    # Text, or token ids for the completions endpoint.
    prompt: str | tuple[int, ...]
    # Tokens as the server counts them (special tokens included); the fallback when the server
    # reports no usage.
    prompt_len: int
    max_tokens: int
    # "short" / "long" in the mixed dataset; the dataset's name otherwise.
    request_class: str


@dataclass(frozen=True)
class Workload:
    # Sent on the main arrival process, in order (cycled with --duration).
    requests: tuple[RequestSpec, ...]
    # Sent and awaited before the run; not counted.
    warmups: tuple[RequestSpec, ...] = ()
    # The mixed dataset's i-th long request, made when it is due: each one is new, so that a
    # prefix cache cannot turn the later ones into cheap hits.
    background: Callable[[int], RequestSpec] | None = None
